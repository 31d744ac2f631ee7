import dataclasses

import pytest
import torch

import attnzoo
from attnzoo.registry import Capabilities, Mechanism, register

from mechanism_checks import check_against_reference, check_input_errors, random_inputs, seeded


def test_mechanisms_lists_full_first():
    names = attnzoo.mechanisms()
    assert names[0] == "full"
    assert len(names) == len(set(names))


def test_unknown_mechanism_lists_known_ones():
    with pytest.raises(ValueError, match="known mechanisms: full"):
        attnzoo.get("fulll")
    with pytest.raises(ValueError, match="unknown mechanism"):
        attnzoo.attention(*random_inputs()[:3], mechanism="nope")


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_every_spec_is_complete(name):
    spec = attnzoo.get(name)
    assert spec.name == name
    assert spec.summary and spec.time and spec.memory and spec.citation
    assert dataclasses.is_dataclass(spec.options)
    spec.options()  # every option has a default
    assert callable(spec.fn) and callable(spec.reference)
    if not spec.capabilities.causal:
        assert spec.reason_not_causal


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_every_mechanism_refuses_bad_input(name):
    check_input_errors(name)


@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_every_mechanism_matches_its_reference_with_defaults(name):
    # Self-attention, odd length; the mechanism files test their options and limits.
    check_against_reference(name, Lq=11, Lk=11, causal=attnzoo.get(name).capabilities.causal)


def test_register_rejects_clashing_option_names():
    @dataclasses.dataclass(frozen=True)
    class Opts:
        k: int = 3

    spec = Mechanism(name="clash", summary="s", options=Opts, fn=print, reference=print,
                     capabilities=Capabilities(), time="t", memory="m", citation="c")
    with pytest.raises(ValueError, match="clash"):
        register(spec)
    assert "clash" not in attnzoo.mechanisms()


def test_register_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register(attnzoo.get("full"))


def test_devices_must_agree_message():
    q, k, v, _ = random_inputs()
    with pytest.raises(ValueError, match="sequence lengths"):
        attnzoo.attention(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match="torch.Tensor"):
        attnzoo.attention(q.cpu().numpy(), k, v)
    with pytest.raises(ValueError, match="generator"):
        attnzoo.attention(q, k, v, generator=0)


@pytest.mark.parametrize("name", [n for n in attnzoo.mechanisms() if attnzoo.get(n).randomized])
def test_a_generator_on_another_device_than_q_is_refused(name):
    # A randomized mechanism draws on q's device, which torch refuses for a generator elsewhere:
    # ours says which device to give it. (The meta device stands in for a GPU on CPU machines.)
    q = torch.randn(1, 2, 8, 4, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu but q on meta"):
        attnzoo.attention(q, q, q, mechanism=name, generator=torch.Generator())


def test_connectivity_of_full_is_dense_or_causal():
    assert attnzoo.connectivity("full", length=4, causal=False).all()
    torch.testing.assert_close(attnzoo.connectivity("full", length=3, causal=True),
                               torch.ones(3, 3, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="length"):
        attnzoo.connectivity("full", length=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", attnzoo.mechanisms())
def test_low_precision_error_is_a_small_multiple_of_fulls(name, dtype):
    # Tolerance as in PyTorch's flex-attention tests: a multiple of what full attention itself
    # loses in that dtype against the float64 result, not a magic number.
    spec = attnzoo.get(name)
    causal = spec.capabilities.causal
    q, k, v, _ = random_inputs(B=2, H=2, Lq=37, Lk=37, D=16, seed=3)
    k = q if name == "lsh" else k  # a shared-QK-like input keeps LSH buckets meaningful

    def rel_err(mech, dt):
        run = lambda q, k, v: attnzoo.attention(q, k, v, mechanism=mech, causal=causal,  # noqa: E731
                                                generator=seeded(1))
        low = [t.to(dt) for t in (q, k, v)]
        gold = run(*(t.double() for t in low))  # the same (rounded) inputs: decisions agree
        out = run(*low)
        assert out.dtype == dt and torch.isfinite(out).all()
        return ((out.double() - gold).norm() / gold.norm()).item()

    assert rel_err(name, dtype) <= 5 * rel_err("full", dtype) + 1e-6
