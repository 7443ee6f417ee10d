"""`quantize publish RUN --org ORG`: push a gated run to a Hugging Face Hub repo."""

from __future__ import annotations

from pathlib import Path

import click

from quantize.cli.app import handle_errors, main


def _size(n: int) -> str:
    from quantize.textfmt import human_bytes

    return human_bytes(n, top="GiB")


@main.command("publish")
@click.argument("run", type=click.Path(path_type=Path, file_okay=False))
@click.option("--org", required=True, help="Hub organisation (or user) that gets the repo")
@click.option("--name", default=None,
              help="repo name (default <base>-<recipe>, e.g. SmolLM2-135M-Instruct-gptq-int4)")
@click.option("--private/--public", default=True, show_default=True,
              help="visibility of a new repo (an existing repo keeps its own)")
@click.option("--dry-run", is_flag=True,
              help="write the exact repo contents to a folder and list them; no network")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="folder for --dry-run, outside the run folder (default "
                   "<run>/publish/<org>/<name>)")
@click.option("--force", is_flag=True,
              help="publish although the release gate failed or did not run (the card says "
                   "so); never overrides broken or mismatched files")
@click.option("--overwrite", is_flag=True,
              help="write to an existing repo that quantize did not make (no "
                   "quantize/repo.json) or that holds another recipe's model; its files of "
                   "the same names are replaced, no file this tool did not upload is deleted")
@click.option("--base-model", default=None,
              help="Hub id of the base model when the run cannot tell (local folders)")
@click.option("--license", "license_", default=None,
              help="licence id for the card when the base model's is unknown")
@handle_errors
def publish_cmd(run: Path, org: str, name: str | None, private: bool, dry_run: bool,
                out: Path | None, force: bool, overwrite: bool, base_model: str | None,
                license_: str | None) -> None:
    """Publish RUN (a run folder) to the Hugging Face Hub as one commit: the export, a model
    card with the eval table and gate verdict, and the raw results: exactly the files the
    run's manifest lists, regular files read without following links. Refuses a failed gate
    (unless --force), an incomplete export, files that no longer match the manifest or that it
    does not list, and an existing repo quantize did not make (unless --overwrite). The token
    comes from HF_TOKEN or `hf auth login`."""
    from quantize.stages.publish import PublishOptions, publish

    if out is not None and not dry_run:
        raise click.UsageError("--out is only for --dry-run")
    res = publish(PublishOptions(run=run, org=org, name=name, private=private, dry_run=dry_run,
                                 force=force, overwrite=overwrite, out=out,
                                 base_model=base_model,
                                 license=license_))
    total = sum(size for size, _ in res.files.values())
    vis = "private" if res.private else "public"
    if res.dry_run:
        click.echo(f"dry run: nothing was uploaded (no network used); repo {res.repo_id} "
                   f"({vis}{', forced' if res.forced else ''})")
    elif res.changed:
        click.echo(f"published {res.repo_id} ({vis}): commit {res.commit}")
    else:
        click.echo(f"nothing changed: {res.repo_id} already holds these files "
                   f"(commit {res.commit}); no new commit")
    click.echo(f"{'would upload' if res.dry_run else 'files'} ({len(res.files)}, "
               f"{_size(total)}) from {res.folder}:")
    width = max(len(rel) for rel in res.files)
    for rel, (size, sha) in res.files.items():
        click.echo(f"  {rel:<{width}}  {_size(size):>10}  sha256 {sha[:16]}")
    if res.deleted:
        click.echo(f"deleted from the repo (uploaded by an earlier publish, not in this run): "
                   f"{', '.join(res.deleted)}")
    if res.dry_run:
        click.echo("on publish, only files an earlier quantize publish put in the repo (listed "
                   "in its quantize/repo.json) and not listed here are deleted; an existing "
                   "repo without that marker is refused unless --overwrite")
    elif res.url:
        click.echo(res.url)
