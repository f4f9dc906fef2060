"""Secrets never reach what the harness writes (core/redact.py): the name rule, each form a secret takes in text,
and every writer that records environment, commands or URLs (report, baseline cache, pip logs, wheelhouse
manifest)."""

from __future__ import annotations

import io
import json
import stat
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cache import baseline as baseline_cache
from harness.checks.check import Check
from harness.core.redact import MASK, is_secret_name, redact_argv, redact_env, redact_text, redact_tree
from harness.run.report import Report, write_report

SECRET_NAMES = [
    "HF_TOKEN",
    "VLLM_API_KEY",
    "PGPASSWORD",
    "DB_PASSWD",
    "GCP_CREDS",
    "PROXY_AUTH",
    "--api-key",
    "--hf-token",
    "api_key",
    "OPENAI_APIKEY",
    "AWS_SECRET_ACCESS_KEY",
    "GITHUB_TOKEN",
    "HFTOKEN",
    "AWS_SESSION",
    "VLLM_TEST_DB_PASSWD",
    "CLIENT_SECRET",
    "SSH_PRIVATE_KEY",
]
PLAIN_NAMES = [
    "TOKENIZERS_PARALLELISM",
    "prompt_token_ids",
    "first_token",
    "pd_token",
    "cache_key",
    "key",
    "KEY",
    "VLLM_CPU_KVCACHE_SPACE",
    "XDG_SESSION_TYPE",
    "PWD",
    "OLDPWD",
    "max_tokens",
    "--max-num-batched-tokens",
    "kv_connector",
    "SESSION",
    "--tokenizer",
    "VLLM_MAX_TOKENS_PER_EXPERT",
    "GIT_AUTHOR_NAME",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_credential_names_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_token_ids_lookup_keys_and_settings_are_not(name):
    assert not is_secret_name(name)


# a secret's value: long enough not to occur by chance in the text around it
values = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.+~%-", min_size=6, max_size=40).map(
    lambda s: "Zq" + s
)
FORMS = [
    "HF_TOKEN={v} python -m vllm.entrypoints.openai.api_server --port 8000",
    "env VLLM_API_KEY='{v}' python",
    'PGPASSWORD="{v}" psql',
    "vllm serve m --api-key {v} --port 1",
    "vllm serve m --hf-token={v}",
    "HF_ENDPOINT=https://user:{v}@hub.example/ python",
    "pip install --index-url https://__token__:{v}@pypi.example/simple vllm",
    "git clone https://{v}@git.example/x.git",
    "non-default args: {{'model': 'm', 'api_key': '{v}', 'port': 1}}",
    '{{"HF_TOKEN": "{v}", "x": 1}}',
]


@settings(max_examples=60, deadline=None)
@given(v=values, form=st.sampled_from(FORMS))
def test_no_form_of_a_secret_survives_redaction(v, form):
    out = redact_text(form.format(v=v))
    assert v not in out and MASK in out


def test_what_is_not_secret_is_left_as_it_was():
    text = (
        "python -m vllm --model /m --max-num-batched-tokens 512 first_token=5 {'prompt_token_ids': '1 2'} http://h:80/x"
    )
    assert redact_text(text) == text


def test_argv_env_and_trees_mask_values_and_keep_names():
    assert redact_argv(["vllm", "--api-key", "s3cret1", "--port", "1", "HF_TOKEN=t0ken1"]) == [
        "vllm",
        "--api-key",
        MASK,
        "--port",
        "1",
        f"HF_TOKEN={MASK}",
    ]
    assert redact_env({"HF_TOKEN": "a1b2c3", "HF_HOME": "/h", "URL": "https://u:p4ss@h/"}) == {
        "HF_TOKEN": MASK,
        "HF_HOME": "/h",
        "URL": f"https://{MASK}@h/",
    }
    tree = redact_tree({"env": {"HF_TOKEN": "a1b2c3"}, "key": "cachekey1", "urls": ["https://u:p4ss@h/"]})
    assert tree == {"env": {"HF_TOKEN": MASK}, "key": "cachekey1", "urls": [f"https://{MASK}@h/"]}


FAKE = {
    "HF_TOKEN": "fake-hf-0001",
    "VLLM_DB_PASSWD": "fake-pw-0002",
    "HF_MIRROR": "https://me:fake-url-0003@m.example/",
}
SECRETS = ["fake-hf-0001", "fake-pw-0002", "fake-url-0003", "fake-key-0004", "fake-att-0005"]


def assert_no_secret_in(folder):
    for path in folder.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert not [s for s in SECRETS if s in text], path


def test_a_report_holds_no_secret_from_commands_attach_urls_or_excerpts(tmp_path):
    env = " ".join(f"{k}={v}" for k, v in FAKE.items())
    report = Report(
        config={"attach": {"prefill_url": "http://op:fake-att-0005@p.example:8000"}, "tp_p": 1},
        commands={"prefill": f"{env} python -m vllm serve m --api-key fake-key-0004"},
        checks=[Check("x", False, "log: HF_TOKEN=fake-hf-0001 seen")],
    )
    write_report(report, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md"}
    assert_no_secret_in(tmp_path)
    assert "HF_TOKEN=***" in (tmp_path / "report.json").read_text()  # the name stays: a reader sees it was set


def test_a_baseline_cache_entry_holds_no_secret_and_is_the_owners_only(tmp_path):
    environ = {**FAKE, "VLLM_CPU_KVCACHE_SPACE": "4", "HOME": "/root"}
    inherited = baseline_cache.inherited_env(environ)
    assert (
        "HF_TOKEN" not in inherited and "VLLM_DB_PASSWD" not in inherited and inherited["VLLM_CPU_KVCACHE_SPACE"] == "4"
    )
    ident = baseline_cache.command_identity(["python", "-m", "vllm", "--api-key", "fake-key-0004"], {**environ})
    entry = tmp_path / "entry.json"
    baseline_cache.write_atomic_json(entry, {"identity": ident, "inherited": inherited})
    assert_no_secret_in(tmp_path)
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_pip_logs_hold_no_index_credentials(tmp_path):
    from harness.wheelhouse.pip import run_pip

    log = io.StringIO()
    log.name = str(tmp_path / "pip.log")
    run_pip(
        sys.executable,
        ["--version", "--index-url", "https://__token__:fake-key-0004@pypi.example/simple"],
        log,
        check=False,
    )
    (tmp_path / "pip.log").write_text(log.getvalue())
    assert "pypi.example" in log.getvalue()
    assert_no_secret_in(tmp_path)


def test_a_wheelhouse_manifest_records_its_index_without_credentials():
    manifest = {
        "sources": {
            "index_url": "https://__token__:fake-key-0004@pypi.example/simple",
            "extra_index_urls": ["https://u:fake-pw-0002@x.example/"],
        }
    }
    out = json.dumps(redact_tree(manifest))
    assert "pypi.example/simple" in out and not [s for s in SECRETS if s in out]
