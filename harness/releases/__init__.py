"""vLLM releases: listing them from the package index, bisecting an entry's outcome over them, the release history."""
