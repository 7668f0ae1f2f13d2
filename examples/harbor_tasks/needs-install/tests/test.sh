#!/bin/bash
[ -f /app/fetch.py ] && grep -q requests /app/fetch.py && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
