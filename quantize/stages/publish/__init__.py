"""publish: a finished, gated run → one commit in a Hugging Face Hub model repo.

Order of work:
1. read the run defensively and refuse what must not ship (run_files.py, nofollow.py): an
   export that is missing, incomplete, no longer matches the manifest hashes, or holds
   anything the manifest does not list or anything but regular files (links are never
   followed anywhere inside the run); eval/gate results that do not match their hashes or
   belong to an older export; a failed (or absent) gate unless `--force`; a failed
   verification;
2. find out what the base model is (base.py) and write the exact repo contents into a folder
   (repo.py: `<run>/publish/<org>/<name>/`, or `--out` outside the run for a dry run): the
   files the export's manifest lists (hard links), the model card, the raw results and the
   repo marker `quantize/repo.json` (marker.py);
3. unless `--dry-run`: pin and re-hash every staged file (pinned.py), then create the repo,
   or check that the existing one carries this tool's marker for this model (else refuse
   unless `--overwrite`), and push the folder as ONE commit (hub.py). Files already on the
   Hub with the same content are skipped (so re-publishing the same run makes no commit);
   only files the previous marker lists that the run no longer has are deleted; transient
   errors (429, 5xx, connection drops) retry the whole step, which is safe because it is
   idempotent.

flow.py runs the steps. The token comes from HF_TOKEN or the stored login (`hf auth login`)
and is passed to the client only; every message that could carry it is redacted.
"""

from __future__ import annotations

from quantize.stages.publish.base import KNOWN_BASES, resolve_base
from quantize.stages.publish.flow import NAME, PublishOptions, PublishResult, publish
from quantize.stages.publish.hub import (
    endpoint,
    explain,
    hub_token,
    is_transient,
    online_token,
    upload,
)
from quantize.stages.publish.marker import MARKER
from quantize.stages.publish.messages import redact, warn
from quantize.stages.publish.repo import PROVENANCE_DIR, card_inputs, provenance, repo_id_for
from quantize.stages.publish.run_files import ExportManifest, RunFiles, read_run

__all__ = ["KNOWN_BASES", "MARKER", "NAME", "PROVENANCE_DIR", "ExportManifest", "PublishOptions",
           "PublishResult", "RunFiles", "card_inputs", "endpoint", "explain", "hub_token",
           "is_transient", "online_token", "provenance", "publish", "read_run", "redact",
           "repo_id_for", "resolve_base", "upload", "warn"]
