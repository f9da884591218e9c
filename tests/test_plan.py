"""`blocklab plan`: per-device bytes from shapes, checked against a hand count;
the compiled step's temporaries; the command's table, JSON and refusals."""

import json

import numpy as np
import pytest
from _procs import blocklab

from blocklab import ConfigError, DecoderConfig
from blocklab.interop import config_of
from blocklab.training.plan import plan


def _llama_params(V, d, H, K, N, F):
    # hand count: embedding + head, per block 2 norms + q,o (d x d) + k,v (d x Kp)
    # + 3 FFN matrices, final norm
    p = d // H
    block = 2 * d + 2 * d * d + 2 * d * K * p + 3 * d * F
    return 2 * V * d + N * block + d


def test_llama3_8b_has_its_published_size_and_fsdp_divides_it():
    cfg = config_of("llama3-8b")
    n = _llama_params(128256, 4096, 32, 8, 32, 14336)
    assert n == 8_030_261_248  # the model card's 8.03 B
    for devices in (8, 64, 256):
        r = plan("llama3-8b", f"data={devices}")
        assert r.num_params == n and r.devices == devices
        # float32 weights split over every device; each layer's int32 RoPE
        # theta replicated
        assert r.params_bytes == 4 * n // devices + 4 * 32
        # AdamW: two moments like the float weights (+ a replicated int32 count)
        assert r.opt_bytes == 2 * 4 * n // devices + 4
    assert cfg.num_kv_heads == 8


def test_tensor_parallel_splits_only_what_the_rules_name():
    r = plan("llama3-70b", "data=1,model=8", rules="tp")
    cfg = config_of("llama3-70b")
    d, N = cfg.num_hiddens, cfg.num_blks
    # the norms (2 per block + final) are replicated, the rest splits 8 ways
    norms = (2 * N + 1) * d
    assert r.params_bytes == 4 * ((r.num_params - norms) // 8 + norms) + 4 * N


def test_a_json_config_file_and_refusals(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(DecoderConfig.llama(num_hiddens=48).to_dict()))
    assert config_of(str(path)).num_hiddens == 48
    with pytest.raises(ConfigError, match="preset"):
        config_of("llama-9000")
    with pytest.raises(
        ConfigError, match=r"W_q\.weight.*'heads'.*\{'data': 1, 'model': 3\}"
    ):
        plan("llama3-8b", "data=1,model=3", rules="tp")


@pytest.mark.slow  # two child processes, each compiling a training step
def test_the_compiled_step_reports_temporaries_that_grow_with_the_batch():
    small = plan("llama", "data=2", batch=2, seq_len=32, compile=True)
    large = plan("llama", "data=2", batch=16, seq_len=32, compile=True)
    assert small.compiled and 0 < small.temp_bytes < large.temp_bytes
    # the compiled step's inputs: parameters + Adam state per device, the
    # sum this module computes from shapes (plus the key)
    assert abs(small.argument_bytes - small.params_bytes - small.opt_bytes) < 64


def test_the_command_prints_a_table_and_json():
    rc, out, err = blocklab("plan", "--config", "llama3-8b", "--mesh", "data=8",
                            "data=64", "--json")  # fmt: skip
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert [p["devices"] for p in plans] == [8, 64]
    assert np.isclose(plans[0]["params_bytes"], 8 * plans[1]["params_bytes"])
    rc, out, err = blocklab("plan", "--config", "llama3-8b", "--mesh", "data=x")
    assert rc == 2 and "data=8,model=4" in err
