"""telemetry.read on the answer shapes of each server family; a figure not reported is None, never 0.
(The real servers' answers are read in test_engine_http.py and the test_served_*.py modules; ik_llama.cpp's
server is not built here, so its shape, from its source, is checked on its own.)"""

from gatekeeper.engines.served.telemetry import Telemetry, read


def test_llama_cpp_timings():
    answer = {"usage": {"prompt_tokens": 120},
              "timings": {"cache_n": 100, "prompt_n": 20, "prompt_ms": 40.0, "predicted_n": 5, "predicted_ms": 250.0}}
    assert read(answer) == Telemetry(120, 100, 0.04, 0.25)


def test_ik_llama_timings_without_cache_n_take_the_cached_count_from_usage():
    answer = {"usage": {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 96}},
              "timings": {"prompt_n": 24, "prompt_ms": 48.0, "predicted_ms": 100.0}}
    assert read(answer) == Telemetry(120, 96, 0.048, 0.1)
    assert read({"timings": {"prompt_n": 24, "prompt_ms": 48.0}}).cached_tokens is None  # and neither: unknown


def test_vllm_usage_and_per_request_metrics():
    answer = {"usage": {"prompt_tokens": 1064, "prompt_tokens_details": {"cached_tokens": 992}},
              "metrics": {"time_to_first_token_ms": 257.0, "generation_time_ms": 998.7, "queue_time_ms": 0.02}}
    assert read(answer) == Telemetry(1064, 992, 0.257, 0.9987)
    # started without --enable-prompt-tokens-details / --enable-per-request-metrics: not reported
    assert read({"usage": {"prompt_tokens": 10, "prompt_tokens_details": None}}) == Telemetry(10, None, None, None)


def test_sglang_meta_info():
    assert read({"meta_info": {"prompt_tokens": 50, "cached_tokens": 32}}) == Telemetry(50, 32, None, None)


def test_nothing_reported_or_garbage_is_unknown_not_zero():
    assert read({"usage": {"prompt_tokens": 10, "completion_tokens": 3}}) == Telemetry(10, None, None, None)
    assert read(None) == read("x") == read({"usage": "x", "timings": [1]}) == Telemetry()
    assert read({"usage": {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": "5"}}}) == Telemetry()
