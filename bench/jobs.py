"""The job file: one small YAML that says what to measure, on what, against what.

A job names the model (a bench/make_model.py preset, `default` for the embedded default model,
or a folder), the driver that measures each row (one of the single-run scripts that already
exist, so the measuring code stays where it was checked), the rows (a recipe or a variant
each, with extra driver arguments), the calibration, the values to keep and the baseline: the
rows measured in the same run that every other row's ratios are taken against. Keeping this
declarative is what lets the same file run here and on the GPU machine, and lets the renderer
find its rows again by job name.

    name: quantize-speed-8b
    driver: quant_run
    model: llama3.1-8b
    device: cuda
    calibration: bench/calib-128x2048.yaml
    rows:
      - {label: gptq-a, recipe: gptq-int4}
      - {label: asym32, recipe: gptq-int4-asym-g32}
      - {label: gptq-b, recipe: gptq-int4}
    baseline: [gptq-a, gptq-b]
    measure: [quantize_s, wall_s, gpu_peak_alloc_gib]
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

JOBS_DIR = Path(__file__).resolve().parent / "jobs"

# driver -> the values it can report (the record's `values` keys)
DRIVER_VALUES: dict[str, tuple[str, ...]] = {
    "quant_run": ("quantize_s", "wall_s", "calibrate_s", "gpu_peak_alloc_gib",
                  "gpu_peak_reserved_gib", "rss_peak_gib", "safetensors_out_gib"),
    "portable_probe": ("wiki_ppl", "novel_ppl", "quantize_s"),
    "consumer_ppl": ("wiki_ppl", "novel_ppl", "seconds"),
    "make_quantize": ("wall_s", "quantize_s", "eval_s", "eval_baseline_s", "eval_candidate_s",
                      "import_s"),
}
# values where lower is better *and* the ratio users want is a recovery (baseline / value):
# perplexity. Every other value's ratio is value / baseline (a time or memory factor).
RECOVERY_VALUES = frozenset({"wiki_ppl", "novel_ppl"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Row(_Strict):
    label: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
    recipe: str | None = Field(default=None, description="recipe name or YAML path")
    variant: str | None = Field(default=None, description="portable_probe variant name")
    loader: str | None = Field(default=None, description="consumer_ppl: which loader's column")
    args: list[str] = Field(default_factory=list, description="extra driver arguments")
    title: str | None = Field(default=None, description="the row's text in rendered tables")
    against: list[str] | None = Field(default=None,
                                      description="this row's own baseline rows (default: "
                                                  "the job's)")


class Job(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    description: str
    driver: Literal["quant_run", "portable_probe", "consumer_ppl", "make_quantize"]
    model: str = "default"
    device: Literal["cpu", "cuda"] = "cpu"
    calibration: str | None = None
    rows: list[Row] = Field(min_length=1)
    baseline: list[str] = Field(default_factory=list,
                                description="row labels measured in the same run; ratios "
                                            "are taken against their mean")
    measure: list[str] = Field(min_length=1)
    timeout_s: int = Field(default=3600, gt=0, description="per row")

    @model_validator(mode="after")
    def _consistent(self) -> Job:
        labels = [r.label for r in self.rows]
        if len(set(labels)) != len(labels):
            raise ValueError(f"duplicate row labels in {labels}")
        missing = [b for b in [*self.baseline, *(x for r in self.rows for x in r.against or [])]
                   if b not in labels]
        if missing:
            raise ValueError(f"baseline {missing} is not a row label (rows: {labels})")
        unknown = [m for m in self.measure if m not in DRIVER_VALUES[self.driver]]
        if unknown:
            raise ValueError(f"driver {self.driver} does not measure {unknown} (it reports "
                             f"{', '.join(DRIVER_VALUES[self.driver])})")
        need = {"quant_run": "recipe", "portable_probe": "variant", "consumer_ppl": "loader"}
        field = need.get(self.driver)
        if field and any(getattr(r, field) is None for r in self.rows):
            raise ValueError(f"every row of a {self.driver} job needs `{field}`")
        return self

    def row(self, label: str) -> Row:
        return next(r for r in self.rows if r.label == label)

    def baseline_of(self, label: str) -> list[str]:
        """The rows `label`'s ratios are taken against; none for a baseline row itself."""
        row = self.row(label)
        if row.against is not None:
            return row.against
        return [] if label in self.baseline else self.baseline


def load_job(path: str | Path) -> Job:
    """A job by file path or by name (bench/jobs/NAME.yaml); errors name the file."""
    p = Path(path)
    if not p.suffix and not p.exists():
        p = JOBS_DIR / f"{path}.yaml"
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
        return Job.model_validate(data)
    except FileNotFoundError:
        raise SystemExit(f"{p}: no such job file (bench/jobs/ holds "
                         f"{', '.join(sorted(x.stem for x in JOBS_DIR.glob('*.yaml')))})") from None
    except Exception as exc:
        raise SystemExit(f"{p}: {exc}") from exc


def all_jobs() -> dict[str, Job]:
    return {p.stem: load_job(p) for p in sorted(JOBS_DIR.glob("*.yaml"))}
