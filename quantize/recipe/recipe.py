"""Declarative inputs: recipes, calibration specs and eval suites.

Every model is strict (`extra="forbid"`), loaded from YAML that rejects duplicate keys, and
every error names the file, line, field and fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, TypeAdapter, model_validator

from quantize.errors import RecipeError
from quantize.recipe.consumers import ConsumerName, cannot_apply, default_consumers
from quantize.recipe.engines import BackendName, check_recipe
from quantize.recipe.methods import METHODS, OPTION_BLOCKS, MethodName, ObserverName
from quantize.recipe.metric_kinds import (
    METRIC_KINDS,
    AnswerFlipsSpec,
    MetricBase,
    TextMetric,
    paired_names,
)
from quantize.recipe.options import (
    AutoRoundOptions,
    AWQOptions,
    GPTQOptions,
    MixedPrecision,
    Rotation,
    SmoothQuantOptions,
)
from quantize.recipe.paths import PROJECT_ROOT, contained
from quantize.recipe.schemes import SCHEMES, Scheme, SchemeName
from quantize.recipe.strict import Name, Strict
from quantize.recipe.yamlio import expected, parse_model, read_text

# The recipe `quantize run`, `make quantize` and `quantize fit` use when none is named: the
# best 4-bit checkpoint measured on the default model that every consumer loads correctly
# with no extra code (no online transform; issue #46, bench/RESULTS.md). The Makefile's
# RECIPE default repeats it (tests/unit/recipe/test_recipe.py checks they agree). `quantize fit`
# takes its scheme and rotation and makes its own per-layer assignment.
DEFAULT_RECIPE = "gptq-int4-asym-g32"
# the methods a recipe's `rotation:` is measured with (rotations before AWQ's smoothing or
# AutoRound's tuning are not: the recipe loader refuses them)
ROTATED_METHODS = ("gptq", "rtn")

GroupSize = Annotated[int, Field(ge=8, le=4096)] | Literal["auto"]


# --- calibration -----------------------------------------------------------------------
class CalibrationSpec(Strict):
    """Where calibration text comes from and how it becomes token sequences."""

    name: Name = "inline"
    description: str = ""
    builtin: Literal["wiki"] | None = Field(
        default=None, description="text shipped inside the package (offline default)")
    path: str | None = Field(default=None, description="a .txt/.jsonl/.parquet file or folder")
    hub: str | None = Field(default=None, description="a Hugging Face dataset id (online)")
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    num_samples: int = Field(default=32, ge=1, le=100_000)
    seq_len: int = Field(default=512, ge=16, le=131_072)
    seed: int = 0
    chat_template: bool = False
    packing: bool = Field(
        default=True,
        description="concatenate texts and cut exact seq_len windows (no padding); "
        "false: one text per sample, truncated, and shorter texts skipped")
    allow_external_path: bool = Field(
        default=False, description="allow an absolute path or one that leaves the spec's folder")

    @model_validator(mode="after")
    def _one_source(self) -> CalibrationSpec:
        given = [k for k in ("builtin", "path", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one source: `builtin: wiki`, `path: <file or folder>` or "
                f"`hub: <dataset id>` (got {', '.join(given) or 'none'})")
        return self


# --- eval suites -----------------------------------------------------------------------
EngineName = Literal["hf", "vllm", "auto"]  # what scores a suite (quantize.stages.eval)


# A suite's metric: the model of its kind (quantize/recipe/metric_kinds.py), chosen by `kind`.
MetricSpec = MetricBase

# Fields added after runs were made: left out of the measured settings while at their
# default, so the eval keys of those runs stay valid (quantize.stages.eval.measured_settings).
LATER_FIELDS = {"score_from": None, "top_k": 32, "of": None}
# The fields every metric had when metrics were one flat model, with their defaults: added to
# each metric's measured settings where its kind's model lacks them, so the keys of runs
# made then stay valid.
FLAT_FIELDS: dict[str, object] = {
    "builtin": None, "path": None, "hub": None, "subset": None, "split": "test",
    "text_field": "text", "max_tokens": 16_384, "seq_len": 512, "stride": None, "task": None,
    "limit": None, "num_fewshot": 0, "allow_external_path": False}


def metric_union() -> Any:
    """The type of a suite's `metrics` items: the table's kinds, discriminated by `kind`."""
    specs = tuple(Annotated[k.spec, Tag(k.name)] for k in METRIC_KINDS.values())
    return Annotated[Union[specs], Discriminator(  # noqa: UP007
        _kind_of, custom_error_type="unknown_kind",
        custom_error_message=f"kind: Input should be {expected(METRIC_KINDS)}")]


def _kind_of(value: Any) -> str | None:
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


def parse_metric(data: dict[str, Any]) -> MetricSpec:
    """One metric from its fields, as a suite reads it (tests, benchmarks, code)."""
    spec: MetricSpec = TypeAdapter(metric_union()).validate_python(data)
    return spec


class EvalSuite(Strict):
    name: Name
    description: str = ""
    batch_size: int = Field(default=8, ge=1, le=1024)
    engine: EngineName | None = Field(
        default=None, description="what scores the suite: hf (transformers + lm-eval), vllm "
        "(prompt log-probabilities in the vLLM environment) or auto; a recipe's eval.engine "
        "and `quantize eval --engine` override it")
    # the kinds' union (metric_union): set by rebuild_suite below, after an entry is added
    metrics: list[MetricSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> EvalSuite:
        names = [m.name for m in self.metrics]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"metric names must be unique; repeated: {sorted(dup)}")
        kinds = {m.name: m.kind for m in self.metrics}
        for m in self.metrics:
            if m.kind != "answer_flips":
                continue
            assert isinstance(m, AnswerFlipsSpec)
            pooled = m.of if m.of is not None else paired_names(kinds)
            wrong = [n for n in pooled if kinds.get(n) != "multiple_choice"]
            if wrong or not pooled:
                raise ValueError(f"metric {m.name}: answer_flips compares multiple_choice "
                                 f"metrics of this suite; {wrong or 'none'} "
                                 f"{'is not one' if wrong else 'found'} (known: "
                                 f"{paired_names(kinds)})")
        return self

    def flips_of(self, spec: AnswerFlipsSpec) -> list[str]:
        """The multiple_choice metrics an answer_flips metric pools."""
        return spec.of if spec.of is not None else paired_names(
            {m.name: m.kind for m in self.metrics})


def rebuild_suite() -> None:
    """Let EvalSuite take every kind of the table: called here, and again by whoever adds or
    removes a kind at run time (tests/unit/metrics/test_kinds.py)."""
    EvalSuite.model_fields["metrics"].annotation = list[metric_union()]  # type: ignore[misc,assignment]
    EvalSuite.model_rebuild(force=True)


rebuild_suite()


class EvalRef(Strict):
    suite: Name = "default"
    thresholds: dict[str, Annotated[float, Field(gt=0.0, le=2.0)]] = Field(
        default_factory=dict, description="per-metric minimum recovery; may only tighten")
    engine: EngineName | None = Field(
        default=None, description="what scores the eval (hf, vllm, auto); overrides the suite's, "
        "`quantize eval --engine` overrides this")


# --- recipes ---------------------------------------------------------------------------
class Override(Strict):
    """A different scheme for some layers (e.g. keep down_proj at 8 bits)."""

    targets: list[str] = Field(min_length=1)
    scheme: SchemeName
    group_size: GroupSize | None = None


class Recipe(Strict):
    name: Name
    description: str = Field(min_length=1, description="one line shown by `quantize recipes`")
    backend: BackendName = Field(
        default="llmcompressor", description="the engine: llmcompressor (compressed-tensors "
        "checkpoints), gptqmodel (native GPTQ/AWQ), autoawq (native AWQ, legacy)")
    method: MethodName
    scheme: SchemeName
    group_size: GroupSize | None = None
    observer: ObserverName | None = Field(
        default=None, description="how weight scales are chosen: minmax (library default), "
        "mse, imatrix_mse (importance-weighted by the calibration activations)")
    targets: list[str] = Field(default_factory=lambda: ["Linear"], min_length=1)
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    overrides: list[Override] = Field(default_factory=list)
    smoothquant: SmoothQuantOptions | None = None
    rotation: Rotation | None = None
    consumers: list[ConsumerName] | None = Field(
        default=None, min_length=1, description="the programs the export is advertised for "
        "(transformers, lm-eval-hf, transformers+transforms, vllm): the gate fails when one "
        "of them loads it wrong, and the card lists only these. Default: every consumer that "
        "can load it (with online rotations: vllm and transformers+transforms)")
    mixed_precision: MixedPrecision | None = None
    gptq: GPTQOptions | None = None
    awq: AWQOptions | None = None
    autoround: AutoRoundOptions | None = None
    kv_cache: Literal["fp8"] | None = None
    calibration: Name | CalibrationSpec = "wiki"
    eval: EvalRef = Field(default_factory=EvalRef)
    trust_remote_code: bool = False
    calibrate_all_experts: bool = Field(
        default=True, description="MoE: every expert's layers see every calibration token "
        "(llm-compressor's moe_calibrate_all_experts); false: only the tokens the router "
        "sends them, as in serving (an expert nobody routes to is then never calibrated)")
    batch_size: Annotated[int, Field(ge=1, le=512)] | Literal["auto"] = Field(
        default="auto",
        description="calibration forward batch size; auto: 8 on a GPU when every sample has "
        "the same length (packing), else 1 (bench/RESULTS.md: same GPTQ losses, faster)")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        info = SCHEMES[self.scheme]
        if self.group_size is not None and (info.fixed_group or info.block):
            fixed = f"groups of {info.fixed_group}" if info.fixed_group else \
                f"{info.block[0]}x{info.block[1]} blocks" if info.block else ""
            raise ValueError(
                f"scheme {self.scheme} fixes its own {fixed} (vLLM recognises no other), so "
                "group_size does not apply; remove group_size")
        if self.group_size is not None and not info.group:
            raise ValueError(
                f"scheme {self.scheme} quantizes per channel/tensor, so group_size does not "
                "apply; remove group_size or use a grouped scheme such as W4A16")
        method = METHODS[self.method]
        if method.weight_only and info.activations != "none":
            raise ValueError(
                f"{method.label} is weight-only; scheme {self.scheme} also quantizes "
                "activations. Use W4A16_ASYM/W4A16, or method gptq/rtn")
        nvfp4 = info.weight_type == "float" and info.fixed_group == 16
        if self.method != "rtn" and info.weight_type != "int" and not (nvfp4 and method.nvfp4):
            raise ValueError(f"{method.label} needs an integer scheme; {self.scheme} is float. "
                             "Use method: rtn for FP8" + (", or method: gptq for NVFP4"
                                                          if nvfp4 else ""))
        if self.smoothquant is not None and info.activations == "none":
            raise ValueError("smoothquant only helps schemes that quantize activations "
                             f"(W8A8, FP8...); {self.scheme} is weight-only. Remove it")
        for opt in OPTION_BLOCKS:
            if getattr(self, opt) is not None and opt not in method.options:
                takes = [m for m, info_ in METHODS.items() if opt in info_.options]
                raise ValueError(f"`{opt}:` options given but method is {self.method}; "
                                 f"remove them or set method: {' or '.join(takes)}")
        if not self.calibrate_all_experts and self.backend != "llmcompressor":
            raise ValueError(f"calibrate_all_experts: false is an llm-compressor option; the "
                             f"{self.backend} engine has no such switch. Remove it or use "
                             "backend: llmcompressor")
        if method.symmetric_only and not info.symmetric:
            raise ValueError(f"{method.label} cannot use the asymmetric scheme {self.scheme} "
                             f"({method.symmetric_only}); use scheme W4A16 (symmetric), or "
                             "method gptq for an asymmetric grid")
        if self.observer is not None and self.method == "autoround":
            raise ValueError("AutoRound tunes its own scales; remove `observer` (it applies "
                             "to gptq, awq, awq+gptq and rtn)")
        if set(self.targets) & set(self.ignore):
            raise ValueError(f"{sorted(set(self.targets) & set(self.ignore))} is both targeted "
                             "and ignored; remove it from one list")
        if self.rotation is not None and (self.method not in ROTATED_METHODS
                                          or self.backend != "llmcompressor"):
            raise ValueError(f"rotation: is measured with methods {' and '.join(ROTATED_METHODS)}"
                             f" on the llmcompressor engine; this recipe has method "
                             f"{self.method}, backend {self.backend}. Remove rotation or use "
                             "method: gptq")
        if self.consumers is not None and self.online_transforms and (
                bad := cannot_apply(self.consumers)):
            raise ValueError(
                f"consumers {bad} load checkpoints without their online rotations (transformers "
                "ignores transform_config), so this recipe's export would compute another model "
                "there; remove them from consumers (vllm and transformers+transforms apply the "
                "rotations), or remove rotation for an export every consumer loads")
        if self.mixed_precision is not None:
            self._check_mixed(info)
        if self.backend != "llmcompressor":
            check_recipe(self)
        return self

    def _check_mixed(self, info: Scheme) -> None:
        if info.weight_type != "int" or info.activations != "none" or info.weight_bits >= 8:
            raise ValueError(f"mixed_precision raises layers from the recipe's scheme to 8-bit "
                             f"weights (W8A16); {self.scheme} is not a weight-only integer "
                             "scheme below 8 bits. Remove mixed_precision or use W4A16_ASYM")
        if self.backend != "llmcompressor":
            raise ValueError("mixed_precision writes per-layer schemes, which only the "
                             f"llmcompressor engine exports; remove it or drop backend: "
                             f"{self.backend}")

    @property
    def online_transforms(self) -> bool:
        """Whether the export needs transforms applied online at run time (rotations)."""
        return self.rotation is not None

    @property
    def advertised_consumers(self) -> tuple[str, ...]:
        """The consumers the export is advertised for: the recipe's, else every one that
        can load it (quantize/recipe/consumers.py)."""
        return tuple(self.consumers or default_consumers(self.online_transforms))

    @property
    def needs_calibration(self) -> bool:
        """Whether the engine needs calibration data for this recipe at all."""
        info = SCHEMES[self.scheme]
        data_free = (self.method == "rtn" and info.activations != "fp8-static"
                     and not info.needs_data
                     and self.kv_cache is None and self.smoothquant is None
                     # llm-compressor applies rotations at calibration start: no pass, none
                     and self.rotation is None)
        return not data_free


# --- loading -----------------------------------------------------------------------------
def _dir(kind: str) -> Path:
    return PROJECT_ROOT / kind


def available(kind: str) -> list[str]:
    """Names of the YAML files shipped in recipes/, calibration/ or eval/."""
    d = _dir(kind)
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def resolve(kind: str, name_or_path: str) -> Path:
    """A name from the shipped folder, or a path to a YAML file; did-you-mean on a typo."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.is_file():
            raise RecipeError(problem="no such file", path=name_or_path,
                              hint=f"give a path to a YAML file or one of the names from "
                                   f"`quantize {kind}`")
        return p
    candidate = _dir(kind) / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = available(kind)
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    label = {"recipes": "recipe", "calibration": "calibration spec", "eval": "eval suite"}[kind]
    raise RecipeError(problem=f"unknown {label} {name_or_path!r}",
                      hint=f"{hint}known: {', '.join(names)}")


def _load(kind: str, model: type[Strict], name_or_path: str) -> Any:
    path = resolve(kind, name_or_path)
    obj = parse_model(model, read_text(path), str(path))
    if hasattr(obj, "name") and kind != "calibration" and obj.name != path.stem:
        raise RecipeError(problem=f"name {obj.name!r} differs from the file name {path.stem!r}",
                          hint="make them equal (one name per artifact)", path=path)
    return obj


def load_recipe(name_or_path: str) -> Recipe:
    recipe: Recipe = _load("recipes", Recipe, name_or_path)
    return recipe


def load_calibration(name_or_path: str) -> tuple[CalibrationSpec, Path]:
    """The spec and the folder its relative paths are resolved against."""
    path = resolve("calibration", name_or_path)
    spec: CalibrationSpec = _load("calibration", CalibrationSpec, name_or_path)
    return spec, path.parent


def load_suite(name_or_path: str) -> EvalSuite:
    """The suite, with each metric's `path` resolved against the suite file's folder (never
    the current directory) and kept inside it unless the metric allows external paths."""
    folder = resolve("eval", name_or_path).parent
    suite: EvalSuite = _load("eval", EvalSuite, name_or_path)
    metrics = []
    for m in suite.metrics:
        if isinstance(m, TextMetric) and m.path is not None:
            inside = contained(folder, m.path, m.allow_external_path,
                               f"eval suite {suite.name!r}: metric {m.name} path", str(folder))
            m = m.model_copy(update={"path": str(inside)})
        metrics.append(m)
    return suite.model_copy(update={"metrics": metrics})


def apply_thresholds(suite: EvalSuite, ref: EvalRef) -> EvalSuite:
    """The suite with the recipe's thresholds applied; recipes may only tighten."""
    names = {m.name for m in suite.metrics}
    unknown = set(ref.thresholds) - names
    if unknown:
        raise RecipeError(problem=f"eval.thresholds names {sorted(unknown)}, not in suite "
                                  f"{suite.name!r} (metrics: {sorted(names)})",
                          hint="fix the name")
    metrics = []
    for m in suite.metrics:
        t = ref.thresholds.get(m.name)
        if t is not None and t < m.threshold:
            raise RecipeError(
                problem=f"eval.thresholds.{m.name}={t} loosens the suite's {m.threshold}",
                hint="recipes may only tighten thresholds (edit the suite to loosen)")
        metrics.append(m.model_copy(update={"threshold": t}) if t is not None else m)
    return suite.model_copy(update={"metrics": metrics})


def canonical_hash(obj: BaseModel | dict[str, Any]) -> str:
    """sha256 of a model's canonical JSON: the same content always hashes the same."""
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def suite_for(recipe: Recipe, override: str | None) -> EvalSuite:
    """The eval suite a run uses: `override` (--suite) or the recipe's, with the recipe's
    tightened thresholds. Under another suite than the recipe's, that suite's thresholds
    stand and the recipe's apply only where they name the same metric and are stricter."""
    suite = load_suite(override or recipe.eval.suite)
    ref = recipe.eval
    if override and override != ref.suite:
        current = {m.name: m.threshold for m in suite.metrics}
        ref = ref.model_copy(update={"thresholds": {
            k: v for k, v in ref.thresholds.items() if v > current.get(k, float("inf"))}})
    return apply_thresholds(suite, ref)
