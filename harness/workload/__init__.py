"""What a run sends: the prompt sets and the OpenAI-style client that sends them and parses the answers."""
