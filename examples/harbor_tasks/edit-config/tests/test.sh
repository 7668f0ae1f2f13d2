#!/bin/bash
# The workspace is at $APP_HOME (the Dockerfile's ENV and WORKDIR).
python3 - <<'PY' > /logs/verifier/reward.txt
import configparser, os
c = configparser.ConfigParser()
c.read(os.path.join(os.environ["APP_HOME"], "conf/server.ini"))
ok = (c.get("http", "port", fallback="") == "8088" and c.get("http", "host", fallback="") == "127.0.0.1"
      and c.get("log", "port", fallback="") == "514" and c.get("log", "level", fallback="") == "info")
print(1 if ok else 0)
PY
