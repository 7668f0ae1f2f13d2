#!/bin/bash
printf 'import sys, requests\nprint(requests.get(sys.argv[1]).status_code)\n' > fetch.py
