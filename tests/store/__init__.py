"""Tests of the store: schema, store, recorder, SQL, exports (harness/store/)."""
