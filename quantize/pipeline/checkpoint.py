"""`quantize eval CHECKPOINT`: evaluate and gate an export folder on its own.

Its manifest.json names the source model (the baseline) and recipe.yaml the suite and the
recipe's thresholds. Writes eval.json/eval.md and gate.json/gate.md into `out`.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from quantize.errors import EvalError
from quantize.model.config import config_path
from quantize.model.source import model_fingerprint, resolve_model
from quantize.recipe.recipe import Recipe, load_recipe, suite_for
from quantize.run.files import atomic_dir
from quantize.run.manifest import MANIFEST, read_export_manifest, versions
from quantize.run.results import EvalSummary, GateSummary
from quantize.stages import eval as eval_stage
from quantize.stages import gate as gate_stage
from quantize.stages.eval.engine import EvalEngineRequest, choose, requested_engine


@dataclass(frozen=True)
class CheckpointEval:
    """What eval and the gate found on an export folder (their reports are in `out`)."""

    eval: EvalSummary
    gate: GateSummary


def is_checkpoint(folder: Path) -> bool:
    """An export folder (config.json beside its manifest), not a run folder."""
    return config_path(folder).is_file()


def _recipe(folder: Path, name: str) -> Recipe:
    # the export keeps the recipe as `recipe.yaml`; the loader wants file name == recipe name
    with tempfile.TemporaryDirectory() as d:
        named = Path(d) / f"{name}.yaml"
        named.write_text((folder / "recipe.yaml").read_text(encoding="utf-8"), encoding="utf-8")
        return load_recipe(str(named))


def evaluate(folder: Path, suite_name: str | None, out: Path, device: str,
             engine: EvalEngineRequest | None = None) -> CheckpointEval:
    if not is_checkpoint(folder) or not (folder / MANIFEST).is_file():
        raise EvalError(path=folder, path_sep=" ",
                        problem="is neither a run folder nor an export of one (no config.json "
                                "+ manifest.json)",
                        hint="give runs/<model>-<recipe> or its export/")
    manifest = read_export_manifest(folder / MANIFEST)
    if manifest.model is None or manifest.recipe is None:
        raise EvalError(path=folder / MANIFEST, path_sep=" ", problem="names no model or recipe",
                        hint="re-export the run")
    model = resolve_model(manifest.model.source)
    fingerprint = model_fingerprint(model)
    if fingerprint != manifest.model.fingerprint:
        raise EvalError(problem=f"the baseline model {manifest.model.source} changed since "
                                "this checkpoint was made (fingerprint differs)",
                        hint="evaluate against the model it came from")
    recipe = _recipe(folder, manifest.recipe.name)
    suite = suite_for(recipe, suite_name)
    req = engine or EvalEngineRequest()
    req = replace(req, engine=requested_engine(req.engine, recipe.eval.engine, suite.engine))
    choice = choose(req, folder, model.path, recipe.kv_cache is not None, device)
    from quantize.metrics.consumers import measured_here

    with atomic_dir(out) as tmp:
        result = eval_stage.run(folder, model.path, fingerprint, suite, device, versions(), tmp,
                                choice, measured_here(recipe.online_transforms),
                                recipe.trust_remote_code)
        rules = {m.name: m for m in suite.metrics}
        verdict = gate_stage.run(gate_stage.with_rules(gate_stage.read_eval(tmp), rules,
                                                       recipe.advertised_consumers), tmp)
    return CheckpointEval(result, verdict)
