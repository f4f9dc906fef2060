import pytest

from harness.checks.check import Check
from harness.checks.smoke import CHECK_NAME, SMOKE_PROMPT, completion_text, judge_smoke, smoke_request


def test_request_body_is_greedy_and_short():
    assert smoke_request("TinyLlama/TinyLlama-1.1B-Chat-v1.0") == {
        "model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        "prompt": "The capital of France is",
        "max_tokens": 10,
        "temperature": 0,
    }
    assert SMOKE_PROMPT == "The capital of France is"


@pytest.mark.parametrize(
    "text", [" Paris.", " Paris, the city of light", "Paris", ' "Paris"', " **Paris**.", "\nParis\n"]
)
def test_paris_first_passes(text):
    c = judge_smoke(text)
    assert isinstance(c, Check) and c.name == CHECK_NAME and c.passed, c.detail


@pytest.mark.parametrize(
    "text,why",
    [
        (" London.", "no 'Paris'"),
        (" the city of Paris.", "appears but is not the first word"),
        (" Parisian food", "no 'Paris'"),
        ("\ufffd\ufffd\ufffd", "garbage"),
        (" 1 2 3 4 5", "garbage"),
        ("", "empty completion"),
        ("   ", "empty completion"),
        (None, "empty completion"),
    ],
)
def test_anything_else_fails_with_a_reason(text, why):
    c = judge_smoke(text, where="proxy")
    assert not c.passed and why in c.detail and c.detail.startswith("proxy: ")
    assert c.data is not None
    assert c.data["completion"] == text


def test_a_failed_request_is_a_failed_check():
    c = judge_smoke(None, error="HTTP 500: Internal server error")
    assert not c.passed and "HTTP 500" in c.detail


def test_completion_text():
    assert completion_text({"choices": [{"text": " Paris."}]}) == " Paris."
    assert completion_text({"choices": []}) is None
