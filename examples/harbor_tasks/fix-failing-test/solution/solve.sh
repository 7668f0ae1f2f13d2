#!/bin/bash
sed -i 's/(len(values) + 1)/len(values)/' mathutils.py
