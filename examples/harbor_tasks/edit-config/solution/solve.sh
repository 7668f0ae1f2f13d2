#!/bin/bash
python3 - <<'PY'
lines, section = open("conf/server.ini").read().splitlines(), None
for i, line in enumerate(lines):
    if line.startswith("["):
        section = line.strip("[]")
    elif section == "http" and line.startswith("port"):
        lines[i] = "port = 8088"
open("conf/server.ini", "w").write("\n".join(lines) + "\n")
PY
