import math

import pytest

from harness.serve.prometheus import first_present, metric_sum, parse_metrics

TEXT = """# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 12345.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 42.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 5.0
weird{a="x\\"y,z",b="back\\\\slash"} NaN 1700000000
inf_metric -Inf

"""


def test_parse_and_sum():
    s = parse_metrics(TEXT)
    assert metric_sum(s, "vllm:nixl_xfer_time_seconds_count") == 3.0
    assert metric_sum(s, "vllm:prompt_tokens_by_source_total") == 47.0
    assert metric_sum(s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 42.0
    assert metric_sum(s, "vllm:prompt_tokens_by_source_total", source="nope") == 0.0
    assert metric_sum(s, "absent") is None
    assert "vllm:nixl_bytes_transferred_sum" in {x.name for x in s}


def test_escapes_nan_inf_and_timestamp():
    s = {x.name: x for x in parse_metrics(TEXT)}
    assert s["weird"].labels == {"a": 'x"y,z', "b": "back\\slash"}
    assert math.isnan(s["weird"].value)
    assert s["inf_metric"].value == -math.inf
    assert s["vllm:nixl_xfer_time_seconds_bucket"].labels["le"] == "+Inf"


def test_first_present_follows_renames():
    s = parse_metrics(TEXT)
    assert first_present(s, ["vllm:old_name", "vllm:nixl_num_failed_transfers_total"]) == (
        "vllm:nixl_num_failed_transfers_total",
        0.0,
    )
    assert first_present(s, ["a", "b"]) is None


@pytest.mark.parametrize("bad", ["1abc 3", 'm{a="x} 1', "m", "m{a=x} 1", "m notanumber"])
def test_malformed_lines_name_the_line(bad):
    with pytest.raises(ValueError, match="line 2"):
        parse_metrics("ok 1\n" + bad)
