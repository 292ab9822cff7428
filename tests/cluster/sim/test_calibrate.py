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
    # Quantized weights: steps under the engine's dense_min_rows run the weight-only kernels,
    # the others a dense copy; the fit keeps that threshold (dense weights: none).
    assert fitted.small_rows == (0 if weights == "dense" else 8)
    path = tmp_path / "fit.json"
    fitted.save(path)
    loaded = LinearCostModel.load(path)
    assert loaded.name == fitted.name and loaded.small_rows == fitted.small_rows
    assert loaded.step_time(decode) == fitted.step_time(decode)


def test_quantized_steps_are_fitted_piecewise_at_the_dense_switch() -> None:
    """Steps under ``small_rows`` tokens cost the quantized kernels' steep per-row price, the
    larger ones a dense copy's fixed read and a shallow slope: a fit with the threshold
    recovers such costs, where one straight line over the batch sizes could not."""

    def seconds(rows: int) -> float:
        return 0.008 + (0.0008 * rows if rows < 8 else 0.004 + 0.0002 * rows)

    shapes = [StepShape(num_decodes=n, decode_context=100 * n) for n in range(1, 33)]
    samples = [(shape, seconds(shape.num_decodes)) for shape in shapes]
    piecewise = LinearCostModel.fit("pw", samples, 1, small_rows=8)
    straight = LinearCostModel.fit("line", samples, 1)
    for shape, want in samples:
        assert piecewise.step_time(shape) == pytest.approx(want, rel=1e-6)
    assert max(abs(straight.step_time(s) / t - 1) for s, t in samples) > 0.05


def test_the_fit_reports_its_error_on_scenarios_it_was_not_fitted_to() -> None:
    """The notes' errors are the fit's own steps; a scenario left out of the fit shows what the
    model does on steps it has not seen, which is what the simulator asks of it. Decode steps
    that cost more per row past 4 rows, fitted with one straight line: each step's error with
    its scenario left out is at least its error in sample."""

    def seconds(rows: int) -> float:
        return 0.008 + 0.001 * rows if rows <= 4 else 0.003 * rows

    samples, groups = [], []
    for rows in (1, 2, 3, 4, 8, 16, 32):
        for _ in range(2):  # (each scenario twice, as calibrate's repeats)
            samples.append((StepShape(num_decodes=rows), seconds(rows)))
            groups.append(f"decode x{rows}")
    fitted = LinearCostModel.fit("line", samples, 1, groups=groups)
    notes = fitted.notes
    assert notes["samples"] == 14 and notes["groups"] == 7
    assert notes["held_out_median_relative_error"] >= notes["median_relative_error"]
    assert notes["held_out_p90_relative_error"] > notes["p90_relative_error"]
    # Without scenarios, only the in-sample figures (a saved model compares equal as before).
    assert "held_out_median_relative_error" not in LinearCostModel.fit("l", samples, 1).notes
