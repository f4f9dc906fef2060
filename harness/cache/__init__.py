"""What the harness keeps on disk between runs to skip work: a baseline's answers, by a key over every input that
can change them (``baseline.py``)."""
