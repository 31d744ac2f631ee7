import torch

import attnzoo
from attnzoo.bench.patterns import connectivity_of, draw, weights_of
from attnzoo.cli import main


def test_draws_both_grids(tmp_path):
    paths = draw(tmp_path, length=24, causal=True)
    assert [p.name for p in paths] == ["connectivity.png", "weights.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_weights_from_identity_values_reproduce_the_output():
    for name in attnzoo.mechanisms():
        w = weights_of(name, 20, True, {}, seed=1)
        assert w.shape == (20, 20) and torch.isfinite(w).all()
    w_full = weights_of("full", 20, True, {}, seed=1)
    torch.testing.assert_close(w_full.sum(-1), torch.ones(20, dtype=w_full.dtype))
    assert not w_full.triu(1).any()


def test_data_dependent_connectivity_is_seeded():
    a = connectivity_of("lsh", 32, False, {"bucket_size": 4}, seed=0)
    b = connectivity_of("lsh", 32, False, {"bucket_size": 4}, seed=0)
    assert torch.equal(a, b) and a.shape == (32, 32)


def test_cli_patterns(tmp_path, capsys):
    assert main(["patterns", "--mechanisms", "strided,fixed", "--length", "16",
                 "--option", "strided.stride=4", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "connectivity.png").exists()
    assert main(["patterns", "--option", "strided.nope=4", "--out", str(tmp_path)]) == 2
