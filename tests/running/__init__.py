"""Tests of running agents: engine, runner, tasks, judges, reports (harness/running/)."""
