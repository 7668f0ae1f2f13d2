#!/bin/bash
# The agent's test, and hidden cases it never saw; the agent's copy of the test must be unchanged too.
cd /app
cat > /tmp/test_hidden.py <<'PY'
import unittest, sys
sys.path.insert(0, "/app")
from mathutils import mean
class Hidden(unittest.TestCase):
    def test_more(self):
        self.assertEqual(mean([4]), 4)
        self.assertAlmostEqual(mean([1, 2]), 1.5)
unittest.main(argv=["hidden"])
PY
if python3 -m unittest -q test_mathutils 2>/dev/null && python3 /tmp/test_hidden.py 2>/dev/null \
   && grep -q "assertEqual(mean(\[1, 2, 3\]), 2)" test_mathutils.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
