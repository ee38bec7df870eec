"""examples/grpo_trl.py runs (2 steps) and reports a compact row shorter than the packed one."""

import importlib.util
import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_trl.py"


def test_example_runs_two_steps_and_shares_prompts(capsys):
    spec = importlib.util.spec_from_file_location("grpo_trl_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "2", "--prompt-len", "64", "--completion-len", "8"])
    out = capsys.readouterr().out
    ratio = float(re.search(r"T/C (\d+\.\d+)", out).group(1))
    assert ratio > 1.5
    rows = re.findall(r"^\s+(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\S+)\s+(\S+)", out, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2"]
    first_stock, first_shared = float(rows[0][1]), float(rows[0][2])
    assert abs(first_stock - first_shared) < 1e-5  # same completions, same loss (float32)
    # The reference model (beta > 0 by default): no KL before the first update, the same KL after it.
    (kl1_stock, kl1_shared), (kl2_stock, kl2_shared) = [(float(r[3]), float(r[4])) for r in rows]
    assert kl1_stock == kl1_shared == 0.0 and kl2_stock > 0
    assert abs(kl2_shared - kl2_stock) <= 1e-2 * kl2_stock  # printed to 3 digits
