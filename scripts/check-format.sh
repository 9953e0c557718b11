#!/usr/bin/env bash
# Checks that every tracked C++ file is formatted per .clang-format.
# Fix with: git ls-files '*.cc' '*.h' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "check-format.sh: clang-format not installed; skipped" >&2
  exit 0
fi
git ls-files '*.cc' '*.h' | xargs clang-format --dry-run --Werror
