"""The bad-input corpus: malformed recipes, dataset specs, models, eval suites and paths that
escape their folder, each fed to the real CLI (`quantize run/calibrate/validate` through
click's CliRunner). Every case must end with a non-zero exit, exactly one `error:` line that
names the problem (matched by a distinctive phrase), no traceback, and no new file or folder
anywhere under the test's directory (no run folder, no half-written stage).

`COUNTS` (cases per category) is what docs/reliability.md reports:
`python -c "from tests.integration.test_bad_inputs import COUNTS; print(COUNTS)"`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantize.cli import main

Setup = Callable[[Path, Path], None]  # (work folder, tiny model) -> writes the bad input


@dataclass(frozen=True)
class Case:
    category: str  # recipe | dataset | model | suite | path
    id: str
    args: tuple[str, ...]  # CLI args; {work} and {tiny} are substituted
    match: str  # a regex the one error line must contain
    files: tuple[tuple[str, str | bytes], ...] = ()  # written under {work} first
    setup: Setup | None = None


RECIPE_OK = "name: r\ndescription: d\nmethod: gptq\nscheme: W4A16\ngroup_size: 64\n"
RUN = ("--out", "{work}/run", "--device", "cpu")


def recipe(id: str, text: str | bytes, match: str, name: str = "r") -> Case:
    """A recipe file checked by `quantize validate --no-model`."""
    return Case("recipe", id, ("validate", f"{{work}}/{name}.yaml", "--no-model"), match,
                ((f"{name}.yaml", text),))


def run_recipe(id: str, text: str, match: str) -> Case:
    """A recipe that parses but does not fit the model: `quantize run` must stop before
    calibrating, and leave no run folder."""
    return Case("recipe", id, ("run", "{work}/r.yaml", "--model", "{tiny}", *RUN), match,
                (("r.yaml", text),))


def dataset(id: str, dataset_arg: str, match: str,
            files: tuple[tuple[str, str | bytes], ...] = (), category: str = "dataset",
            setup: Setup | None = None) -> Case:
    """`quantize calibrate gptq-int4 --dataset ...` on the tiny model."""
    return Case(category, id, ("calibrate", "gptq-int4", "--model", "{tiny}", "--dataset",
                               dataset_arg, *RUN), match, files, setup)


def spec(body: str, name: str = "spec") -> tuple[str, str]:
    return (f"specs/{name}.yaml", f"name: {name}\n{body}")


def model(id: str, setup: Setup, match: str, *extra: str) -> Case:
    """`quantize run gptq-int4 --model {work}/m` on a broken model folder."""
    return Case("model", id, ("run", "gptq-int4", "--model", "{work}/m", *extra, *RUN), match,
                setup=setup)


SUITE_OK = ("name: s\nmetrics:\n  - name: ppl\n    kind: perplexity\n"
            "    direction: lower_is_better\n    builtin: wiki-eval\n    threshold: 0.9\n")


def suite(id: str, text: str, match: str, category: str = "suite",
          files: tuple[tuple[str, str | bytes], ...] = ()) -> Case:
    """`quantize run fp8-dynamic --suite {work}/suites/s.yaml`: refused before any stage."""
    return Case(category, id, ("run", "fp8-dynamic", "--model", "{tiny}", "--suite",
                               "{work}/suites/s.yaml", *RUN), match,
                (("suites/s.yaml", text), *files))


# --- model folders ----------------------------------------------------------------------
def _copy_model(work: Path, tiny: Path) -> Path:
    m = work / "m"
    shutil.copytree(tiny, m)
    return m


def _no_folder(work: Path, tiny: Path) -> None:
    pass


def _no_config(work: Path, tiny: Path) -> None:
    (_copy_model(work, tiny) / "config.json").unlink()


def _config(**change: object) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        m = _copy_model(work, tiny)
        cfg = json.loads((m / "config.json").read_text())
        cfg.update(change)
        for k, v in change.items():
            if v is None:
                cfg.pop(k)
        (m / "config.json").write_text(json.dumps(cfg))
    return setup


def _config_text(text: str) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        (_copy_model(work, tiny) / "config.json").write_text(text)
    return setup


def _weights(change: Callable[[bytes], bytes]) -> Setup:
    def setup(work: Path, tiny: Path) -> None:
        w = _copy_model(work, tiny) / "model.safetensors"
        w.write_bytes(change(w.read_bytes()))
    return setup


def _pickle_only(work: Path, tiny: Path) -> None:
    m = _copy_model(work, tiny)
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04\x95")


def _no_weights(work: Path, tiny: Path) -> None:
    (_copy_model(work, tiny) / "model.safetensors").unlink()


def _bad_header(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[:8] + b"{" * n + data[8 + n:]  # same sizes, header no longer JSON


def _escape_by_symlink(work: Path, tiny: Path) -> None:
    (work / "specs").mkdir(exist_ok=True)
    (work / "secret.txt").write_text("outside the spec folder\n" * 50)
    (work / "specs" / "link.txt").symlink_to(work / "secret.txt")


CASES: list[Case] = [
    # --- recipes: syntax, duplicates, unknown keys, types, ranges, conflicts ------------------
    recipe("yaml-unclosed-bracket", RECIPE_OK + "targets: [Linear\n", r"r\.yaml:\d+: invalid YAML"),
    recipe("yaml-bad-indent", "name: r\n  description: d\nmethod: gptq\n", r"invalid YAML"),
    recipe("yaml-tab-indent", "name: r\ngptq:\n\tblock_size: 64\n", r"invalid YAML"),
    recipe("yaml-control-char", "name: r\x07\n", r"invalid YAML"),
    recipe("duplicate-key", RECIPE_OK + "method: rtn\n", r"duplicate key 'method'"),
    recipe("duplicate-nested-key", RECIPE_OK + "gptq:\n  block_size: 64\n  block_size: 32\n",
           r"duplicate key 'block_size'"),
    recipe("unknown-key", RECIPE_OK + "bits: 4\n", r"r\.yaml:6: bits: unknown field"),
    recipe("misspelt-key", RECIPE_OK.replace("scheme:", "shceme:"),
           r"scheme: required field is missing.*shceme: unknown field"),
    recipe("missing-required", "name: r\ndescription: d\nscheme: W4A16\n",
           r"method: required field is missing"),
    recipe("group-size-wrong-type", RECIPE_OK.replace("group_size: 64", "group_size: big"),
           r"r\.yaml:5: group_size"),
    recipe("targets-wrong-type", RECIPE_OK + "targets: Linear\n", r"targets: Input should be a "
           r"valid list"),
    recipe("bool-wrong-type", RECIPE_OK + "trust_remote_code: maybe\n",
           r"trust_remote_code: Input should be a valid boolean"),
    recipe("unknown-method", RECIPE_OK.replace("method: gptq", "method: squeeze"),
           r"method: Input should be 'gptq', 'awq', 'rtn', 'autoround' or 'awq\+gptq'"),
    recipe("bits-out-of-range", RECIPE_OK.replace("W4A16", "W5A16"), r"scheme: Input should be"),
    recipe("group-size-too-small", RECIPE_OK.replace("group_size: 64", "group_size: 4"),
           r"group_size.*greater than or equal to 8"),
    recipe("group-size-too-large", RECIPE_OK.replace("group_size: 64", "group_size: 8192"),
           r"group_size.*less than or equal to 4096"),
    recipe("dampening-out-of-range", RECIPE_OK + "gptq:\n  dampening_frac: 1.5\n",
           r"gptq\.dampening_frac: Input should be less than 1"),
    recipe("group-size-on-per-channel", RECIPE_OK.replace("W4A16", "W8A8"),
           r"scheme W8A8 quantizes per channel/tensor, so group_size does not apply"),
    recipe("awq-with-activations",
           "name: r\ndescription: d\nmethod: awq\nscheme: FP8_DYNAMIC\n", r"AWQ is weight-only"),
    recipe("gptq-on-float", "name: r\ndescription: d\nmethod: gptq\nscheme: FP8_DYNAMIC\n",
           r"GPTQ needs an integer scheme"),
    recipe("smoothquant-weight-only", RECIPE_OK + "smoothquant:\n  strength: 0.5\n",
           r"smoothquant only helps schemes that quantize activations"),
    recipe("options-for-other-method", RECIPE_OK.replace("gptq", "rtn") + "gptq:\n"
           "  block_size: 64\n", r"`gptq:` options given but method is rtn"),
    recipe("targeted-and-ignored", RECIPE_OK + "targets: [lm_head]\n",
           r"\['lm_head'\] is both targeted and ignored"),
    recipe("threshold-loosened", RECIPE_OK + "eval:\n  suite: smoke\n  thresholds:\n"
           "    wiki_ppl: 0.5\n", r"eval\.thresholds\.wiki_ppl=0\.5 loosens the suite's 0\.8"),
    recipe("threshold-unknown-metric", RECIPE_OK + "eval:\n  suite: smoke\n  thresholds:\n"
           "    bleu: 0.9\n", r"eval\.thresholds names \['bleu'\], not in suite 'smoke'"),
    recipe("name-differs-from-file", RECIPE_OK.replace("name: r", "name: other"),
           r"name 'other' differs from the file name 'r'"),
    recipe("empty-file", "", r"expected a YAML mapping at the top level"),
    recipe("top-level-list", "- name: r\n", r"expected a YAML mapping at the top level"),
    recipe("not-utf8", b"name: r\ndescription: \xff\xfe\n", r"not UTF-8 text"),
    Case("recipe", "unknown-recipe-name", ("validate", "gptq-int5", "--no-model"),
         r"unknown recipe 'gptq-int5'; did you mean 'gptq-int4'"),
    Case("recipe", "recipe-file-missing", ("validate", "{work}/nope.yaml", "--no-model"),
         r"nope\.yaml: no such file"),
    recipe("unknown-calibration-spec", RECIPE_OK + "calibration: wikii\n",
           r"unknown calibration spec 'wikii'; did you mean 'wiki'"),
    run_recipe("group-size-does-not-divide", RECIPE_OK.replace("group_size: 64",
                                                               "group_size: 96"),
               r"group_size 96 does not divide the input size"),
    run_recipe("targets-match-nothing", RECIPE_OK + "targets: ['re:.*nosuchlayer$']\n",
               r"match no layer of this model"),
    run_recipe("override-matches-nothing", RECIPE_OK + "overrides:\n  - targets: "
               "['re:.*nosuch$']\n    scheme: W8A16\n", r"override targets .* match no layer"),
    # --- dataset specs --------------------------------------------------------------------
    dataset("missing-file", "{work}/nope.txt", r"dataset '.*nope\.txt': no such file"),
    dataset("spec-path-missing", "{work}/specs/spec.yaml", r"calibration path .*gone\.txt "
            r"does not exist", (spec("path: gone.txt\n"),)),
    dataset("empty-file", "{work}/empty.txt", r"holds no text", (("empty.txt", ""),)),
    dataset("blank-lines-only", "{work}/blank.txt", r"holds no text",
            (("blank.txt", "\n   \n\n"),)),
    dataset("not-utf8", "{work}/latin1.txt", r"latin1\.txt is not UTF-8 text \(byte 3\)",
            (("latin1.txt", "caf\xe9 au lait\n".encode("latin-1") * 3),)),
    dataset("too-few-tokens", "{work}/short.txt",
            r"calibration text has \d+ tokens but the spec needs 16384 \(32 samples × 512\)",
            (("short.txt", "A short text.\nAnother one.\n"),)),
    dataset("texts-shorter-than-window", "{work}/specs/spec.yaml",
            r"only 0 texts are long enough, the spec needs 4",
            (spec("path: short.txt\nnum_samples: 4\nseq_len: 64\npacking: false\n"),
             ("specs/short.txt", "Hi.\nOk.\nNo.\nYes.\nFine.\n"))),
    dataset("jsonl-not-json", "{work}/d.jsonl", r"d\.jsonl:2: not a JSON line",
            (("d.jsonl", '{"text": "fine"}\n{broken\n'),)),
    dataset("jsonl-missing-field", "{work}/d.jsonl", r"d\.jsonl:1: no field 'text'",
            (("d.jsonl", '{"content": "no text field"}\n'),)),
    dataset("unsupported-type", "{work}/d.csv", r"d\.csv: unsupported file type",
            (("d.csv", "text\nhello\n"),)),
    dataset("corrupt-parquet", "{work}/d.parquet", r"d\.parquet: cannot read parquet",
            (("d.parquet", b"PAR1 not really parquet"),)),
    dataset("folder-without-text", "{work}/specs/spec.yaml", r"holds no \.txt/\.jsonl/\.parquet",
            (spec("path: data\n"), ("specs/data/readme.md", "nothing to read\n"))),
    dataset("two-sources", "{work}/specs/spec.yaml", r"give exactly one source.*got builtin, "
            r"path", (spec("builtin: wiki\npath: x.txt\n"),)),
    dataset("zero-samples", "{work}/specs/spec.yaml", r"num_samples: Input should be greater "
            r"than or equal to 1", (spec("builtin: wiki\nnum_samples: 0\n"),)),
    dataset("seq-len-too-short", "{work}/specs/spec.yaml", r"seq_len: Input should be greater "
            r"than or equal to 16", (spec("builtin: wiki\nseq_len: 4\n"),)),
    dataset("unknown-spec-key", "{work}/specs/spec.yaml", r"sample_count: unknown field",
            (spec("builtin: wiki\nsample_count: 3\n"),)),
    # --- models ---------------------------------------------------------------------------
    model("missing-folder", _no_folder, r"model folder '.*m' does not exist"),
    model("missing-config", _no_config, r"has no config\.json"),
    model("config-not-json", _config_text("{'model_type': llama"), r"config\.json is not "
          r"valid JSON"),
    model("unsupported-architecture", _config(model_type="nosuchformer"),
          r"unsupported architecture: model_type 'nosuchformer'"),
    model("remote-code-not-trusted", _config(model_type="nosuchformer",
                                             auto_map={"AutoModelForCausalLM": "m.M"}),
          r"needs the model repo's own code; if you trust it set `trust_remote_code: true`"),
    model("config-wrong-types", _config(hidden_size="big"),
          r"unsupported architecture: transformers cannot build model_type 'llama'"),
    model("no-architectures", _config(architectures=None), r"config\.json has no "
          r"`architectures`"),
    model("corrupt-safetensors-header", _weights(_bad_header),
          r"model\.safetensors is not a valid safetensors file"),
    model("impossible-header-length", _weights(lambda d: (10**12).to_bytes(8, "little")
                                               + d[8:]), r"header length \d+ is impossible"),
    model("truncated-weights", _weights(lambda d: d[:-1000]), r"file has \d+ \(truncated\?\)"),
    model("empty-weights", _weights(lambda d: b""), r"shorter than its 8-byte header"),
    model("no-weights", _no_weights, r"has no \*\.safetensors weights"),
    model("pickle-only", _pickle_only, r"holds only pickle weights \(pytorch_model\.bin\); "
          r"pickle can run code.*--allow-pickle"),
    # --- eval suites ----------------------------------------------------------------------
    suite("unknown-metric-kind", SUITE_OK.replace("kind: perplexity", "kind: bleu"),
          r"metrics\.0: kind: Input should be 'perplexity', 'long_perplexity', "
          r"'multiple_choice', 'kl_divergence' or 'answer_flips'"),
    suite("missing-direction", SUITE_OK.replace("    direction: lower_is_better\n", ""),
          r"metrics\.0\.direction: required field is missing"),
    suite("wrong-direction", SUITE_OK.replace("lower_is_better", "higher_is_better"),
          r"a perplexity metric is lower_is_better; set direction accordingly"),
    suite("unknown-direction", SUITE_OK.replace("lower_is_better", "smaller"),
          r"direction: Input should be 'lower_is_better' or 'higher_is_better'"),
    suite("threshold-out-of-range", SUITE_OK.replace("threshold: 0.9", "threshold: 5"),
          r"threshold: Input should be less than or equal to 2"),
    suite("missing-threshold", SUITE_OK.replace("    threshold: 0.9\n", ""),
          r"threshold: required field is missing"),
    suite("duplicate-metric-names", SUITE_OK + SUITE_OK.split("metrics:\n")[1],
          r"metric names must be unique; repeated: \['ppl'\]"),
    suite("multiple-choice-without-task", "name: s\nmetrics:\n  - name: mc\n"
          "    kind: multiple_choice\n    direction: higher_is_better\n    threshold: 0.9\n",
          r"metrics\.0\.task: required field is missing; add it"),
    suite("field-of-another-kind",
          SUITE_OK.replace("threshold: 0.9", "threshold: 0.9\n    task: x"),
          r":8: metrics\.0\.task: unknown field; remove it or check its spelling"),
    suite("no-metrics", "name: s\nmetrics: []\n", r"metrics: List should have at least 1"),
    suite("suite-name-differs", SUITE_OK.replace("name: s\n", "name: t\n"),
          r"name 't' differs from the file name 's'"),
    Case("suite", "unknown-suite-name", ("run", "fp8-dynamic", "--model", "{tiny}", "--suite",
                                         "smokee", *RUN), r"unknown eval suite 'smokee'"),
    # --- paths that leave their folder -----------------------------------------------------
    dataset("calibration-dotdot", "{work}/specs/spec.yaml",
            r"calibration path '\.\./outside\.txt' leaves the spec's folder",
            (spec("path: ../outside.txt\n"), ("outside.txt", "text\n" * 50)), "path"),
    dataset("calibration-absolute", "{work}/specs/spec.yaml",
            r"calibration path '/etc/hostname' leaves the spec's folder",
            (spec("path: /etc/hostname\n"),), "path"),
    dataset("calibration-symlink-out", "{work}/specs/spec.yaml",
            r"calibration path 'link\.txt' leaves the spec's folder",
            (spec("path: link.txt\n"),), "path", _escape_by_symlink),
    suite("eval-text-dotdot", SUITE_OK.replace("builtin: wiki-eval", "path: ../eval.txt"),
          r"metric ppl path '\.\./eval\.txt' leaves .*suites; use a path inside",
          "path", (("eval.txt", "text\n" * 50),)),
    suite("eval-text-absolute", SUITE_OK.replace("builtin: wiki-eval", "path: /etc/hostname"),
          r"metric ppl path '/etc/hostname' leaves", "path"),
]

COUNTS: dict[str, int] = dict(Counter(c.category for c in CASES))


def _fill(arg: str, work: Path, tiny: Path) -> str:
    return arg.replace("{work}", str(work)).replace("{tiny}", str(tiny))


def _snapshot(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_the_corpus_covers_every_kind_of_bad_input() -> None:
    assert len(CASES) >= 40 and len({(c.category, c.id) for c in CASES}) == len(CASES)
    assert set(COUNTS) == {"recipe", "dataset", "model", "suite", "path"}
    assert all(n >= 5 for n in COUNTS.values()), COUNTS


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}-{c.id}" for c in CASES])
def test_bad_input_is_one_clear_error_and_leaves_nothing(
        case: Case, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # a default `runs/` folder would land here and be caught
    monkeypatch.delenv("QUANTIZE_DEBUG", raising=False)
    for rel, content in case.files:
        f = work / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    if case.setup:
        case.setup(work, tiny_model)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(main, [_fill(a, work, tiny_model) for a in case.args])
    out = result.output
    assert result.exit_code == 2, out
    assert isinstance(result.exception, SystemExit)  # handled, not crashed
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert out.rstrip().splitlines()[-1] == errors[0]  # the last line says what went wrong
    assert re.search(case.match, errors[0]), errors[0]
    assert "Traceback" not in out and "internal error" not in out
    assert _snapshot(tmp_path) == before, "left output behind"
    assert not os.path.exists(work / "run")
