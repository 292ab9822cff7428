"""``tandem sim calibrate`` on a tiny random checkpoint: the engine's real steps are timed and
fitted; the fit is named after the form the weights were held in (a dense and an int8 engine
step cost differently, so one fit must not stand for the other), and scenarios longer than
the model's positions are left out rather than failing."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.sim.calibrate import calibrate
from cluster.sim.cost import LinearCostModel, StepShape


@pytest.mark.parametrize(("quantization", "weights"), [("none", "dense"), ("int8", "int8")])
def test_a_fit_names_the_weights_form_it_was_measured_on(
    tiny_model: Path, tmp_path: Path, quantization: str, weights: str
) -> None:
    fitted = calibrate(str(tiny_model), 1, 16, 0.0, 1, quantization)
    assert fitted.name == f"cpu:{tiny_model.name}:threads=1:{weights}"
    assert fitted.notes["weights"] == weights
    assert fitted.notes["quantization"] == quantization
    # The tiny model has 512 positions: only the scenarios that fit ran, and enough did.
    assert fitted.notes["samples"] >= 30
    decode = StepShape(num_decodes=8, decode_context=8 * 100, num_sampled=8)
    assert fitted.step_time(decode) > 0.0
    path = tmp_path / "fit.json"
    fitted.save(path)
    assert LinearCostModel.load(path).name == fitted.name
