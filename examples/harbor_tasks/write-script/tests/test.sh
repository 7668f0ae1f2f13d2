#!/bin/bash
# Named rewards: the share of cases passed is the reward; the script being executable is reported beside it.
cd /app
passed=0; total=3
printf 'one two three\n' > /tmp/a.txt
printf '\n\n  spaced   out   words \n' > /tmp/b.txt
: > /tmp/c.txt
for case in "a.txt 3" "b.txt 3" "c.txt 0"; do
  set -- $case
  got=$(./wordcount.sh "/tmp/$1" 2>/dev/null | tr -d '[:space:]')
  [ "$got" = "$2" ] && passed=$((passed + 1))
done
executable=0; [ -x wordcount.sh ] && executable=1
python3 -c "import json; print(json.dumps({'reward': $passed / $total, 'cases_passed': $passed, 'executable': $executable}))" \
  > /logs/verifier/reward.json
