"""What upstream already knows: the harness's findings mapped to vLLM issue and PR threads
(configs/known_issues.yaml)."""
