"""report.html of one run: what a person reads first (verdict, failure class), the checks, the divergent token
highlighted in both texts where its place is known (and only there), the timeline, and no network."""

import json
import re
from collections.abc import Sequence

import pytest

from harness.checks.check import Check
from harness.render import run_page as run_html
from harness.run.report import Report, write_report
from harness.workload.token_text import divergence_spans, load_decoder, token_span

PIECES = {1: "The", 2: " cat", 3: " sat", 4: " dog", 5: " ran", 6: "."}


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def comparison(spans=True):
    prompts = [
        {"prompt_id": "p00", "status": "exact", "compared_tokens": 3, "divergence": None},
        {
            "prompt_id": "p01",
            "status": "mismatch",
            "compared_tokens": 2,
            "divergence": {
                "position": 1,
                "baseline_token": 2,
                "pd_token": 4,
                "baseline_top": [2],
                "pd_top": [4],
                "tolerated": False,
                "reason": "baseline token not in P/D top-5, P/D token not in baseline top-5",
            },
        },
    ]
    texts = {
        "p00": {"baseline": "The cat sat", "pd": "The cat sat"},
        "p01": {"baseline": "The cat sat.", "pd": "The dog ran."},
    }
    comp = {
        "top_k": 5,
        "passed": False,
        "exact": 1,
        "tolerated": 0,
        "mismatch": 1,
        "prompts": prompts,
        "texts": texts,
        "prompt_tokens": {"p00": 5, "p01": 9},
        "summary": "2 prompts: 1 exact, 0 tolerated (top-5), 1 mismatched",
    }
    if spans:
        ids: dict[str, dict[str, Sequence[int]]] = {"p01": {"baseline": [1, 2, 3, 6], "pd": [1, 4, 5, 6]}}
        comp["token_spans"] = divergence_spans(prompts, ids, texts, decode)
    return comp


def failing_report() -> Report:
    return Report(
        config={"tp_p": 1, "tp_d": 2, "device": "cpu", "served_model_name": "tiny-llama"},
        checks=[
            Check("all_requests_answered", True, "baseline 2/2, P/D 2/2"),
            Check("outputs_match_baseline", False, "2 prompts: 1 exact, 0 tolerated (top-5), 1 mismatched"),
        ],
        comparison=comparison(),
        failure={"class": "checks-failed", "reason": "outputs differ \u2192 see below", "excerpt": "decode log <tail>"},
        timings_s={"wall": 60.0},
        events=[
            {"name": "baseline", "kind": "phase", "start_s": 0.0, "end_s": 20.0, "ok": True},
            {"name": "baseline start-up", "kind": "launch", "start_s": 0.1, "end_s": 15.0, "ok": True},
            {"name": "P/D", "kind": "phase", "start_s": 20.0, "end_s": 58.0, "ok": True},
            {"name": "decode start-up", "kind": "launch", "start_s": 20.1, "end_s": 50.0, "ok": False},
        ],
        logs={"decode": "/nowhere/logs/decode.log"},
    )


def test_token_span_only_where_the_tokenizer_reproduces_the_text():
    assert token_span([1, 2, 3], 1, "The cat sat", decode) == (3, 7)
    assert token_span([1, 2, 3], 3, "The cat sat", decode) == (11, 11)  # the completion ended before this position
    assert token_span([1, 2, 3], 2, "The cat sat and more", decode) == (7, 11)  # what follows the token does not matter
    assert (
        token_span([1, 2, 3], 1, "The cow sat", decode) is None
    )  # the server's text does not begin as these ids decode
    assert token_span([1, 2], 2, "The cat sat", decode) is None  # "ended here" only when the text ended there too

    # bytes of one character: token 2 alone decodes to a replacement character, with token 3 to the character
    def bytewise(ids):
        s = "".join({1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}[i] for i in ids)
        return s.replace("\ufffd\ufffd", "\u00e9")

    assert token_span([1, 2, 3, 4], 1, "a\u00e9b", bytewise) is None  # the next token rewrites it: no text of its own
    assert token_span([1, 2, 3, 4], 2, "a\u00e9b", bytewise) is None  # it rewrites the token before it
    assert token_span([1, 2, 3, 4], 3, "a\u00e9b", bytewise) == (2, 3)


def test_spans_of_a_comparison_and_a_real_tokenizer(tmp_path):
    spans = comparison()["token_spans"]
    assert spans == {"p01": {"baseline": [3, 7], "pd": [3, 7]}}
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["the capital of France is Paris", "the cat sat on the mat"] * 20,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    real, why = load_decoder(str(tmp_path / "m"))
    assert real is not None, why
    text = "the cat is Paris"
    ids = tok.encode(text).ids
    k = 2
    span = token_span(ids, k, text, real)
    assert span is not None
    start, end = span
    assert text[:start] == real(ids[:k]) and text[start:end] == real(ids[: k + 1])[start:] and end > start
    assert load_decoder(str(tmp_path / "none"))[0] is None


def test_the_page_tells_the_verdict_the_failure_and_highlights_the_divergent_token_in_both_texts(tmp_path):
    d = write_report(failing_report(), tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    assert re.search(r'<span class="badge" id="verdict">FAIL</span>', page)
    assert '<b id="failure-class">checks-failed</b>' in page and "decode log &lt;tail&gt;" in page
    assert re.search(r'<tr class="fail"><td>outputs_match_baseline</td><td class="res">FAIL', page)
    card = page[page.index('id="div-p01"') :]
    card = card[: card.index("</div></div>") + 12]
    base, pd = re.findall(r'data-side="(\w+)"><span class="text">(.*?)</span> <span class="note">', card)
    assert base == (
        "baseline",
        'The<mark class="div-token" title="first divergent token"> cat</mark><span class="after"> sat.</span>',
    )
    assert pd == (
        "pd",
        'The<mark class="div-token" title="first divergent token"> dog</mark><span class="after"> ran.</span>',
    )
    assert page.count('<mark class="div-token"') == 2  # the exact prompt has no highlight
    assert (
        d["verdict"] == "fail"
        and json.loads((tmp_path / "run" / "report.json").read_text())["events"][0]["name"] == "baseline"
    )


def test_no_highlight_is_made_up_when_the_place_of_the_token_is_unknown(tmp_path):
    r = failing_report()
    r.comparison = comparison(spans=False)
    r.comparison["token_spans_note"] = "no tokenizer.json for some/model here (local folder or hub cache)"
    page = run_html.render_page(r.to_dict(), tmp_path)
    assert "<mark" not in page and "Not highlighted: no tokenizer.json for some/model" in page
    assert "The dog ran." in page and "token id 4" in page


def test_the_timeline_has_a_bar_per_step_on_one_time_axis_and_marks_a_failed_step(tmp_path):
    page = run_html.render_page(failing_report().to_dict(), tmp_path)
    svg = page[page.index("<svg") : page.index("</svg>")]
    bars = re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)
    assert len(bars) == 4
    x0, w0 = map(float, bars[0])  # the baseline phase: 0..20 s of 60 s
    x_pd, w_pd = map(float, bars[2])  # the P/D phase: 20..58 s
    assert x_pd == pytest.approx(x0 + 20 / 60 * 760, abs=0.2) and w_pd == pytest.approx(38 / 60 * 760, abs=0.2)
    assert "decode start-up (failed)" in svg and 'stroke="#cf222e"' in svg


def test_an_older_report_without_start_times_says_so(tmp_path):
    d = failing_report().to_dict()
    del d["events"]
    page = run_html.render_page(d, tmp_path)
    assert "no start times" in page and "<svg" in page


def test_one_static_file_that_needs_no_network(tmp_path):
    page = run_html.render_page(failing_report().to_dict(), tmp_path)
    assert page.isascii()  # non-ASCII text is written as character references
    assert "outputs differ &#8594; see below" in page
    assert not re.search(r"<(script|link|img|iframe)\b", page, re.I) and "url(" not in page and "@import" not in page
    external = [
        u for u in re.findall(r'(?:src|href)="([^"]+)"', page) if not u.startswith(("#", "file://")) and "://" in u
    ]
    assert external == []
    assert re.findall(r"https?://[^\s\"'<]+", page) == [
        "http://www.w3.org/2000/svg"
    ]  # the SVG namespace, never fetched


def test_links_to_logs_in_the_run_folder_are_relative(tmp_path):
    d = failing_report().to_dict()
    d["logs"] = {"decode": str(tmp_path / "logs" / "decode.log"), "elsewhere": "/var/tmp/x.log"}
    page = run_html.render_page(d, tmp_path)
    assert 'href="logs/decode.log"' in page and 'href="file:///var/tmp/x.log"' in page


def test_a_rendering_error_still_gives_a_page_with_the_verdict(tmp_path, monkeypatch):
    def boom(d):
        raise KeyError("comparison")

    monkeypatch.setattr(run_html, "_comparison", boom)
    page = run_html.render_page(failing_report().to_dict(), tmp_path)
    assert 'id="verdict">FAIL<' in page and "could not be rendered" in page and "KeyError" in page


def test_report_json_and_md_are_unchanged_by_the_page(tmp_path):
    r = Report(config={"tp_p": 1, "tp_d": 1}, checks=[Check("a", True, "ok")])
    d = write_report(r, tmp_path / "run")
    assert "events" not in d  # nothing recorded, nothing added
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["report.html", "report.json", "report.md"]
    assert 'id="verdict">PASS<' in (tmp_path / "run" / "report.html").read_text()


def test_a_long_failure_leads_with_counts_and_folds_the_request_ids(tmp_path):
    from harness.render.run_page import _reason

    ids = ", ".join(f"load{i:03d}-t{i}" for i in range(84))
    detail = "102 prompts: 18 exact, 0 tolerated (top-5), 84 mismatched; first divergence p01-w2 at token 0"
    d = {
        "reason": f"load_outputs_match_baseline: {detail}; mismatched: {ids}",
        "checks": [
            {"name": "load_outputs_match_baseline", "passed": False, "detail": f"{detail}; mismatched: {ids}"},
            {"name": "no_kv_leak", "passed": True, "detail": "idle"},
        ],
    }
    html = _reason(d)
    banner, folded = html.split("<details", 1)
    assert detail in banner and "load083-t83" not in banner
    assert "<summary>the whole reason, with every request id" in folded and "load083-t83" in folded
    assert "<details" not in _reason({"reason": "short", "checks": []})


def test_a_fault_run_leads_with_its_failure_even_where_a_check_made_after_it_failed(tmp_path):
    """A --net-fault run fails with the fault's class and carries the check of P's blocks made after it."""
    reason = "decode: fatal log line: NIXL transfer failure: handshake_setup_failed " + "x" * 300 + " (seen 3 times)"
    r = Report(
        config={"tp_p": 1, "tp_d": 1, "net_fault": "side-channel-blocked"},
        checks=[Check("p_blocks_released_after_fault", False, "kv-leak after side-channel-blocked: 3 held")],
        skipped_checks=[{"name": "no_kv_leak", "reason": "the run ended in the P/D phase"}],
        failure={"class": "handshake-timeout", "reason": reason, "excerpt": "zmq.error.Again"},
        timings_s={"wall": 90.0},
    )
    d = write_report(r, tmp_path / "run")
    page = (tmp_path / "run" / "report.html").read_text()
    banner = page[page.index('id="reason"') : page.index("</header>")]
    assert "handshake_setup_failed" in banner and "kv-leak after" not in banner and "<details" not in banner
    assert '<b id="failure-class">handshake-timeout</b>' in page
    assert re.search(r'<tr class="fail"><td>p_blocks_released_after_fault</td><td class="res">FAIL', page)
    assert '<tr class="skip"><td>no_kv_leak</td><td class="res">not checked' in page
    md = (tmp_path / "run" / "report.md").read_text()
    assert f"Reason: {reason}" in md and "| p_blocks_released_after_fault | FAIL |" in md
    assert "Class: `handshake-timeout`" in md and d["verdict"] == "fail"
