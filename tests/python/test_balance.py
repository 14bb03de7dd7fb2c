"""mtrain.balance: balance_batch and mass_curve through ctypes (docs/BALANCE.md,
"SparseBalance"): assignments in range and deterministic, cost batching never
worse than token balancing on a long-tail mix, tuned levels within their
bounds and the step never lengthened, mass curves nondecreasing shares, the
largest document split over distinct ranks with split_above (and nothing
changed without it), and bad inputs rejected with messages naming them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtrain import MtrainError
from mtrain.balance import DEFAULT_LEVELS, balance_batch, mass_curve

BUDGETS = [
    {"0": ["vertical_and_slash", 100, 50, 0.9], "1": ["vertical_and_slash", 10, 500, 0.9]},
    {"0": ["vertical_and_slash", 3500, 100, 0.9], "1": ["vertical_and_slash", 40, 2000, 0.9]},
]
CAL = {"pair_s": 5e-12, "row_s": 7e-9, "seq_s": 0.0, "linear_flops": 6e14}
HEADS = 4


@pytest.fixture
def budgets(tmp_path):
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(BUDGETS))
    return path


def long_tail(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.05
    short = np.exp(rng.uniform(np.log(1024), np.log(16384), n))
    big = np.exp(rng.uniform(np.log(131072), np.log(524288), n))
    return [int(x) for x in np.where(long, big, short)]


def fake_mass() -> np.ndarray:
    k = np.arange(len(DEFAULT_LEVELS))
    return np.array([1 - (0.3 + 0.1 * h) / 2.0**k for h in range(HEADS)])


def test_assignment_and_determinism(budgets):
    lengths = long_tail(200, 1)
    a = balance_batch(lengths, 8, budgets, CAL, micro_batches=3, tune=False)
    b = balance_batch(lengths, 8, budgets, CAL, micro_batches=3, tune=False)
    assert a.rank_of == b.rank_of and a.micro_of == b.micro_of
    assert all(0 <= r < 8 for r in a.rank_of) and all(0 <= m < 3 for m in a.micro_of)
    assert np.allclose(a.rank_seconds_before, a.rank_seconds_after, rtol=1e-12)
    tok = balance_batch(lengths, 8, budgets, CAL, method="tokens", tune=False)
    assert a.report["max_before"] <= tok.report["max_before"]
    srt = balance_batch(lengths, 8, budgets, CAL, method="sorted", tune=False)
    order = np.argsort(lengths, kind="stable")
    assert all(np.diff(np.array(srt.rank_of)[order]) >= 0)


def test_tuning_bounds_and_step(budgets):
    lengths = long_tail(120, 2)
    res = balance_batch(lengths, 4, budgets, CAL, mass=fake_mass(), bounds=(0.5, 1.5))
    assert res.levels.shape == (4, HEADS)
    assert res.head_scales.min() >= 0.5 and res.head_scales.max() <= 1.5
    rep = res.report
    assert rep["max_after"] <= rep["max_before"] * (1 + 1e-12)
    assert np.isclose(res.rank_seconds_after.max(), rep["max_after"])
    again = balance_batch(lengths, 4, budgets, CAL, mass=fake_mass(), bounds=(0.5, 1.5))
    assert np.array_equal(res.levels, again.levels)


def test_measured_row_pairs(budgets):
    """row_pairs prices every head by its measured pairs per query row: a sequence's seconds
    follow min(causal, round(row_pairs * N)) at the base level, and the tuner then sees levels
    whose measured cost grows (here 4x per level)."""
    k = len(DEFAULT_LEVELS)
    rp = np.array([[5.0 * (h + 1) * 2.0**j for j in range(k)] for h in range(HEADS)])
    base = DEFAULT_LEVELS.index(1.0)
    n = 3000
    one = balance_batch([n], 1, budgets, CAL, tune=False, row_pairs=rp)
    pairs = sum(min(n * (n + 1) // 2, int(np.floor(rp[h, base] * n + 0.5))) for h in range(HEADS))
    nomodel = balance_batch([n], 1, budgets, CAL, tune=False, row_pairs=rp, model={"hidden": 0})
    fixed = CAL["row_s"] * n * HEADS
    assert np.isclose(nomodel.rank_seconds_before[0], CAL["pair_s"] * pairs + fixed, rtol=1e-12)
    assert one.rank_seconds_before[0] > nomodel.rank_seconds_before[0]
    lengths = long_tail(60, 4)
    res = balance_batch(lengths, 4, budgets, CAL, mass=fake_mass(), row_pairs=rp)
    assert res.report["max_after"] <= res.report["max_before"] * (1 + 1e-12)
    with pytest.raises(MtrainError, match="row_pairs has shape"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs=np.ones((2, k)))
    with pytest.raises(MtrainError, match=r"row_pairs\[head 0, level 0\] = -1"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs=-np.ones((HEADS, k)))


def test_measured_row_pairs_grid(budgets):
    """row_pairs on a length grid: at a measured length a sequence costs that length's pairs, in
    between the value interpolated linearly in log N; shapes and lengths are checked."""
    k = len(DEFAULT_LEVELS)
    base = DEFAULT_LEVELS.index(1.0)
    lens = [2000, 8000, 32000]
    rp = np.array(
        [[[3.0 * (i + 1) * (h + 1) + j for j in range(k)] for h in range(HEADS)] for i in range(3)]
    )

    def seconds(n: int, per_row: np.ndarray) -> float:
        pairs = sum(
            min(n * (n + 1) // 2, int(np.floor(per_row[h] * n + 0.5))) for h in range(HEADS)
        )
        return CAL["pair_s"] * pairs + CAL["row_s"] * n * HEADS

    for n, per_row in (
        (8000, rp[1, :, base]),
        (4000, rp[0, :, base] + 0.5 * (rp[1, :, base] - rp[0, :, base])),
        (1000, rp[0, :, base]),
        (100000, rp[2, :, base]),
    ):
        got = balance_batch(
            [n], 1, budgets, CAL, tune=False, row_pairs=rp, row_pairs_lengths=lens,
            model={"hidden": 0},
        )  # fmt: skip
        assert np.isclose(got.rank_seconds_before[0], seconds(n, per_row), rtol=1e-12), n
    with pytest.raises(MtrainError, match=r"row_pairs has shape \(3, 4, 6\), expected \(2, 4, 6\)"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs=rp, row_pairs_lengths=[1, 2])
    with pytest.raises(MtrainError, match="strictly increasing"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs=rp, row_pairs_lengths=[5, 5, 9])
    with pytest.raises(MtrainError, match="row_pairs_lengths without row_pairs"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs_lengths=[5])


def test_row_pairs_file(budgets, tmp_path):
    """row_pairs_file reads a table on a length grid (as tools/balance_row_pairs.py writes it)
    and prices exactly as the same values given as row_pairs with row_pairs_lengths; a table
    that does not fit the budgets is refused naming the file."""
    k = len(DEFAULT_LEVELS)
    lens = [2000, 8000, 32000]
    rp = np.array(
        [[[2.0 * (i + 1) * (h + 1) + j for j in range(k)] for h in range(HEADS)] for i in range(3)]
    )
    table = {
        "format": "mtrain-row-pairs-1",
        "levels": list(DEFAULT_LEVELS),
        "granularity": 128,
        "heads": 2,
        "num_layers": 2,
        "lengths": lens,
        "layers_done": {
            str(layer): rp[:, 2 * layer : 2 * layer + 2, :].tolist() for layer in (0, 1)
        },
    }
    path = tmp_path / "rp.json"
    path.write_text(json.dumps(table))
    lengths = long_tail(40, 9)
    a = balance_batch(lengths, 3, budgets, CAL, mass=fake_mass(), row_pairs_file=path)
    b = balance_batch(
        lengths, 3, budgets, CAL, mass=fake_mass(), row_pairs=rp, row_pairs_lengths=lens
    )
    np.testing.assert_array_equal(a.rank_seconds_after, b.rank_seconds_after)
    np.testing.assert_array_equal(a.rank_of, b.rank_of)
    table["heads"] = 4
    path.write_text(json.dumps(table))
    with pytest.raises(MtrainError, match=r"rp\.json: 2 layers of 4 heads"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs_file=path)
    with pytest.raises(MtrainError, match="not both"):
        balance_batch([100], 1, budgets, CAL, tune=False, row_pairs=rp[0], row_pairs_file=path)


def test_mass_curve(budgets):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((512, 2, 32)).astype(np.float32)
    k = rng.standard_normal((512, 1, 32)).astype(np.float32)
    m = mass_curve(q, k, budgets, 0, granularity=64)
    assert m.shape == (2, len(DEFAULT_LEVELS))
    assert (m >= 0).all() and (m <= 1).all() and (np.diff(m, axis=1) >= 0).all()
    with pytest.raises(MtrainError, match="has 2 heads, q has 3"):
        mass_curve(rng.standard_normal((512, 3, 32)), k, budgets, 0)


def test_bad_inputs(budgets):
    with pytest.raises(MtrainError, match=r"lengths\[1\] = 0"):
        balance_batch([100, 0], 2, budgets, CAL, tune=False)
    with pytest.raises(MtrainError, match="needs mass"):
        balance_batch([100, 200], 2, budgets, CAL)
    with pytest.raises(MtrainError, match="mass has shape"):
        balance_batch([100, 200], 2, budgets, CAL, mass=np.zeros((3, 6)))
    with pytest.raises(MtrainError, match="missing key 'row_s'"):
        balance_batch([100], 2, budgets, {"pair_s": 1.0}, tune=False)
    with pytest.raises(MtrainError, match="ranks 0"):
        balance_batch([100], 0, budgets, CAL, tune=False)
    with pytest.raises(MtrainError, match="method 'fast'"):
        balance_batch([100], 1, budgets, CAL, method="fast", tune=False)
    with pytest.raises(MtrainError, match=r"must hold 1\.0"):
        balance_batch([100], 1, budgets, CAL, levels=(0.5, 2.0), tune=False)


def test_split(budgets):
    lengths = [500000] + [2000 + 100 * i for i in range(60)]
    plain = balance_batch(lengths, 4, budgets, CAL, tune=False)
    off = balance_batch(lengths, 4, budgets, CAL, tune=False, split_above=0.0)
    assert off.rank_of == plain.rank_of and off.split_order == []
    assert off.ranks_of == [[r] for r in plain.rank_of]
    res = balance_batch(lengths, 4, budgets, CAL, tune=False, split_above=1.0)
    assert res.split_order == [0] and res.report["num_split"] == 1
    group = res.ranks_of[0]
    assert len(group) >= 2 and group == sorted(set(group)) and all(0 <= r < 4 for r in group)
    assert res.rank_of[0] == group[0] and res.micro_of[0] == -1
    assert all(
        len(g) == 1 and g[0] == r for g, r in zip(res.ranks_of[1:], res.rank_of[1:], strict=True)
    )
    assert res.report["max_before"] < plain.report["max_before"]
    assert res.rank_idle_seconds.shape == (4,) and (res.rank_idle_seconds >= 0).all()
    again = balance_batch(lengths, 4, budgets, CAL, tune=False, split_above=1.0)
    assert again.ranks_of == res.ranks_of and again.micro_of == res.micro_of
    tuned = balance_batch(lengths, 4, budgets, CAL, mass=fake_mass(), split_above=1.0)
    assert tuned.report["max_after"] <= tuned.report["max_before"] * (1 + 1e-12)
    capped = balance_batch(lengths, 4, budgets, CAL, tune=False, split_above=0.1, max_split=2)
    assert len(capped.ranks_of[0]) == 2


def test_split_bad_inputs(budgets):
    with pytest.raises(MtrainError, match=r"ring_overhead 0\.5"):
        balance_batch([100, 200], 2, budgets, CAL, tune=False, split_above=1.0, ring_overhead=0.5)
    with pytest.raises(MtrainError, match="splitting needs the cost"):
        balance_batch([100, 200], 2, budgets, CAL, method="sorted", tune=False, split_above=1.0)
    with pytest.raises(MtrainError, match=r"max_ranks 3 must be in \[0, ranks 2\]"):
        balance_batch([100, 200], 2, budgets, CAL, tune=False, split_above=1.0, max_split=3)
    with pytest.raises(MtrainError, match="split_above -1"):
        balance_batch([100, 200], 2, budgets, CAL, tune=False, split_above=-1.0)
