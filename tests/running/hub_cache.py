"""A Hugging Face hub cache written in tmp_path, laid out as huggingface_hub lays out a download (its docs, "Manage
the cache"): models--org--name/ with blobs/<hash> holding the bytes, refs/main holding the commit, and
snapshots/<commit>/<file> a relative symlink to its blob. huggingface_hub has no public function that writes one
from local files, so this writes it by hand, naming the folder with huggingface_hub's own repo_folder_name."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the shape of a git commit hash, as refs/main holds one
# A safetensors file that holds no tensor (its header's size, then the header "{}"): weights enough for a cached model
# that a full use takes (harness/running/hub.py looks for them), where a test needs only its config.
NO_TENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


def cache_model(cache: Path, repo_id: str, files: dict[str, bytes] | Path, commit: str = COMMIT) -> Path:
    """Put `files` (name -> bytes, or every file of a model directory) in `cache` as repo_id's main revision; return
    the snapshot directory huggingface_hub resolves the id to."""
    if isinstance(files, Path):
        files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
