"""bench/fla_configs.py: Triton's cached autotuning results become fla's per-GPU config files."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fla_configs


def _config(block: int, warps: int) -> dict:
    return {"kwargs": {"BV": block}, "num_warps": warps, "num_stages": 2, "num_ctas": 1, "maxnreg": None,
            "pre_hook": None, "ir_override": None}


def _tuned(cache: Path, entry: str, kernel: str, key: list, timings: list) -> None:
    folder = cache / entry
    folder.mkdir(parents=True)
    (folder / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))


KEY_BF16 = [16, 32, 128, 128, 64, True, "torch.bfloat16", "torch.float32"]
KEY_FP32 = [16, 32, 128, 128, 64, True, "torch.float32", "torch.float32"]


def test_each_key_keeps_the_configuration_triton_picked(tmp_path):
    cache = tmp_path / "cache"
    _tuned(cache, "a1", "chunk_fwd_kernel_o", KEY_BF16,
           [[_config(32, 4), [0.30, 0.29, 0.31]], [_config(64, 8), [0.21, 0.20, 0.25]], [_config(128, 4), [0.22, 0.19, 0.2]]])
    _tuned(cache, "b2", "chunk_fwd_kernel_o", KEY_FP32, [[_config(32, 4), [0.5, 0.5, 0.5]]])
    kernels = fla_configs.tuned_kernels(cache)
    entries = kernels["chunk_fwd_kernel_o"]
    assert len(entries) == 2
    picked = entries[fla_configs.key_hash(KEY_BF16)]
    assert picked["autotune_key"] == KEY_BF16
    assert picked["config"]["kwargs"] == {"BV": 64} and picked["config"]["num_warps"] == 8
    assert "pre_hook" not in picked["config"]


def test_a_run_adds_its_keys_to_the_files_already_there(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "configs"
    _tuned(cache, "a1", "recompute_w_u_fwd_kernel", KEY_BF16, [[_config(64, 4), [0.1, 0.1, 0.1]]])
    fla_configs.write(fla_configs.tuned_kernels(cache), out, "3.7.1")
    _tuned(tmp_path / "cache2", "c3", "recompute_w_u_fwd_kernel", KEY_FP32, [[_config(32, 2), [0.2, 0.2, 0.2]]])
    fla_configs.write(fla_configs.tuned_kernels(tmp_path / "cache2"), out, "3.7.1")
    data = json.loads((out / "recompute_w_u_fwd_kernel.json").read_text())
    assert data["kernel_name"] == "recompute_w_u_fwd_kernel" and data["triton_version"] == "3.7.1"
    assert set(data["autotune_entries"]) == {fla_configs.key_hash(KEY_BF16), fla_configs.key_hash(KEY_FP32)}
    assert not list(out.glob("*.tmp"))


def test_no_triton_cache_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no Triton cache at .*nothing"):
        fla_configs.main(["--out", str(tmp_path / "o"), "--triton-cache", str(tmp_path / "nothing")])


@pytest.mark.gpu  # fla-core is the gpu extra: this runs in bench/gpu_tests.sh
def test_fla_reads_the_files_back_in_strict_mode(tmp_path, monkeypatch):
    cache_module = pytest.importorskip("fla.ops.utils.cache")
    cache, out = tmp_path / "cache", tmp_path / "configs"
    _tuned(cache, "a1", "chunk_fwd_kernel_o", KEY_BF16, [[_config(64, 8), [0.2, 0.2, 0.2]]])
    fla_configs.write(fla_configs.tuned_kernels(cache), out, "3.7.1")
    monkeypatch.setenv("FLA_CONFIG_DIR", str(out))
    monkeypatch.setattr(cache_module, "FLA_CACHE_MODE", cache_module.FlaCacheMode.STRICT)
    key = cache_module.AutotuneKey(autotune_key=tuple(KEY_BF16))
    assert cache_module.load_cached_config("chunk_fwd_kernel_o", key)["kwargs"] == {"BV": 64}
    other = cache_module.AutotuneKey(autotune_key=tuple(KEY_FP32))
    assert cache_module.load_cached_config("chunk_fwd_kernel_o", other) is None


def test_only_fla_kernels_are_written_when_fla_names_them(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "configs"
    _tuned(cache, "a1", "chunk_fwd_kernel_o", KEY_BF16, [[_config(64, 8), [0.2, 0.2, 0.2]]])
    _tuned(cache, "b2", "_fused_up_proj_swiglu_kernel", KEY_BF16, [[_config(32, 4), [0.1, 0.1, 0.1]]])
    kernels = fla_configs.tuned_kernels(cache)
    fla_configs.write(fla_configs.only(kernels, {"chunk_fwd_kernel_o", "l2norm_fwd_kernel"}), out, "3.7.1")
    assert [p.name for p in out.iterdir()] == ["chunk_fwd_kernel_o.json"]
    assert fla_configs.only(kernels, None) == kernels  # without fla installed: every tuned kernel


@pytest.mark.gpu  # fla-core is the gpu extra: this runs in bench/gpu_tests.sh
def test_fla_names_its_gdn_kernels_and_not_liger_s():
    pytest.importorskip("fla")
    names = fla_configs.fla_kernel_names()
    assert {"chunk_fwd_kernel_o", "recompute_w_u_fwd_kernel", "causal_conv1d_fwd_kernel"} <= names
    assert "_fused_up_proj_swiglu_kernel" not in names
