#!/usr/bin/env python3
"""Regenerate patches/0001-expert-provider-hook.patch from an edited vendored llama.cpp tree.

    python scripts/regen_patches.py PATH/TO/vendor/llama.cpp

Every file that differs from the pinned sdist's copy goes into the patch, except the project's own
sources that build_llama.py copies in (native/). Round trip: build_llama.py applies the result to a
fresh extract and gets the same tree back.
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_llama  # noqa: E402

PATCH = build_llama.REPO / "patches" / "0001-expert-provider-hook.patch"
SKIP_DIRS = {".git", "build", "models", "docs", "media"}


def changed_files(pristine: Path, edited: Path) -> list[str]:
    own = {dst for _, dst in build_llama.NATIVE_FILES}
    changed = []
    for path in sorted(edited.rglob("*")):
        rel = path.relative_to(edited)
        if not path.is_file() or rel.parts[0] in SKIP_DIRS or rel.as_posix() in own:
            continue
        other = pristine / rel
        if not other.exists() or not filecmp.cmp(path, other, shallow=False):
            changed.append(rel.as_posix())
    return changed


def diff(pristine: Path, edited: Path, files: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        for rel in files:
            if (pristine / rel).exists():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(pristine / rel, repo / rel)
        git = ["git", "-c", "user.name=llamapack", "-c", "user.email=llamapack@localhost"]
        subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "pristine"], cwd=repo, check=True)
        for rel in files:
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(edited / rel, repo / rel)
        subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
        return subprocess.run([*git, "diff", "--cached", "--no-color"], cwd=repo, check=True,
                              capture_output=True, text=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("edited", type=Path, help="the edited vendor/llama.cpp directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = build_llama.extract(build_llama.fetch_sdist(), Path(tmp))
        pristine = root / "vendor/llama.cpp"
        files = changed_files(pristine, args.edited.resolve())
        if not files:
            print("no differences from the pinned sources", file=sys.stderr)
            return 1
        text = diff(pristine, args.edited.resolve(), files)
    PATCH.parent.mkdir(exist_ok=True)
    PATCH.write_text(text)
    print(f"wrote {PATCH} ({len(files)} files: {', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
