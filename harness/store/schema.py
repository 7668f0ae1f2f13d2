"""The SQL schema of recorded rollouts, as an append-only list of named migrations.

The schema is a public API: users write SQL against these table, view and column names, so they are never
renamed or removed, and docs/schema.md documents every column (tests/store/test_store.py checks the two agree).
`Store.open` applies the migrations a file lacks, in order, in one transaction.
"""

# Append-only: (name, sql). Never edit or reorder an entry that has shipped; add a new one instead.
# request/response are the largest columns (~8 kB of JSON per 2k-token call): DuckDB's automatic compression
# choice spends 3x longer on them at checkpoint than zstd alone, for the same size, hence USING COMPRESSION.
MIGRATIONS: list[tuple[str, str]] = [
    (
        "create_record_tables",
        """
        CREATE TABLE runs (
            run_id VARCHAR PRIMARY KEY,
            started_at TIMESTAMP NOT NULL,
            ended_at TIMESTAMP,
            harness_version VARCHAR NOT NULL,
            config JSON
        );
        CREATE TABLE episodes (
            episode_id VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL,
            source VARCHAR NOT NULL,
            meta JSON
        );
        CREATE TABLE calls (
            call_id VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,
            episode_id VARCHAR NOT NULL,
            call_index INTEGER NOT NULL,
            endpoint VARCHAR NOT NULL,
            stream BOOLEAN NOT NULL,
            requested_model VARCHAR,
            served_model VARCHAR,
            role_key VARCHAR NOT NULL,
            system_hash VARCHAR,
            tools_hash VARCHAR,
            request JSON NOT NULL USING COMPRESSION zstd,
            response JSON USING COMPRESSION zstd,
            prompt_ids INTEGER[],
            token_source VARCHAR NOT NULL,
            status VARCHAR NOT NULL,
            http_status INTEGER NOT NULL,
            error VARCHAR,
            started_at TIMESTAMP NOT NULL,
            latency_ms DOUBLE NOT NULL,
            ttft_ms DOUBLE,
            weight_version INTEGER NOT NULL,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            extra JSON
        );
        CREATE TABLE choices (
            call_id VARCHAR NOT NULL,
            choice_index INTEGER NOT NULL,
            completion_ids INTEGER[],
            logprobs FLOAT[],
            finish_reason VARCHAR,
            text VARCHAR,
            tool_calls JSON,
            reasoning VARCHAR,
            PRIMARY KEY (call_id, choice_index)
        );
        """,
    ),
    (
        "create_analysis_views",
        """
        CREATE VIEW completions AS
        SELECT c.call_id, c.run_id, c.episode_id, c.call_index, ch.choice_index, c.role_key, c.endpoint,
               c.status, c.started_at, c.latency_ms, c.weight_version,
               coalesce(c.prompt_tokens, len(c.prompt_ids)) AS prompt_tokens,
               len(ch.completion_ids) AS completion_tokens,
               ch.finish_reason, ch.text, ch.tool_calls
        FROM calls AS c LEFT JOIN choices AS ch ON ch.call_id = c.call_id;

        CREATE VIEW episode_summary AS
        WITH per_episode AS (
            SELECT episode_id,
                   arg_min(run_id, started_at) AS first_run_id,
                   count(*) AS n_calls,
                   count(*) FILTER (WHERE status = 'error') AS n_errors,
                   count(*) FILTER (WHERE status = 'cancelled') AS n_cancelled,
                   CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
                   CAST(sum(completion_tokens) AS BIGINT) AS completion_tokens,
                   min(started_at) AS first_call_at, max(started_at) AS last_call_at,
                   sum(latency_ms) AS total_latency_ms
            FROM calls GROUP BY episode_id
        )
        SELECT episode_id, coalesce(e.run_id, p.first_run_id) AS run_id, e.source, e.created_at,
               coalesce(p.n_calls, 0) AS n_calls, coalesce(p.n_errors, 0) AS n_errors,
               coalesce(p.n_cancelled, 0) AS n_cancelled,
               coalesce(p.prompt_tokens, 0) AS prompt_tokens,
               coalesce(p.completion_tokens, 0) AS completion_tokens,
               p.first_call_at, p.last_call_at, coalesce(p.total_latency_ms, 0) AS total_latency_ms
        FROM episodes AS e FULL OUTER JOIN per_episode AS p USING (episode_id);
        """,
    ),
    (
        "create_dataset_run_tables",
        """
        CREATE TABLE tasks (
            run_id VARCHAR NOT NULL,
            task_id VARCHAR NOT NULL,
            split VARCHAR NOT NULL,
            data JSON,
            PRIMARY KEY (run_id, task_id)
        );
        CREATE TABLE episode_outcomes (
            episode_id VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,
            task_id VARCHAR NOT NULL,
            repeat_index INTEGER NOT NULL,
            attempt INTEGER NOT NULL,
            status VARCHAR NOT NULL,
            exit_code INTEGER,
            answer VARCHAR,
            error VARCHAR,
            started_at TIMESTAMP NOT NULL,
            duration_ms DOUBLE NOT NULL,
            log_path VARCHAR
        );
        CREATE TABLE judgements (
            episode_id VARCHAR NOT NULL,
            judge VARCHAR NOT NULL,
            judge_hash VARCHAR NOT NULL,
            reward DOUBLE,
            details JSON,
            error VARCHAR,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE reports (
            run_id VARCHAR NOT NULL,
            judge VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL,
            report JSON NOT NULL
        );
        CREATE VIEW rewards AS
        SELECT o.run_id, o.task_id, o.repeat_index, o.episode_id, o.status, j.judge, j.judge_hash, j.reward,
               j.error AS judge_error, j.created_at AS judged_at
        FROM episode_outcomes AS o
        LEFT JOIN (
            SELECT * FROM judgements
            QUALIFY row_number() OVER (PARTITION BY episode_id, judge ORDER BY created_at DESC) = 1
        ) AS j USING (episode_id);
        """,
    ),
    (
        "create_sample_tables",
        # Built by harness.core.merge from recorded calls; re-merging an episode replaces its rows for that run.
        """
        CREATE TABLE samples (
            sample_id VARCHAR PRIMARY KEY,
            run_id VARCHAR NOT NULL,
            episode_id VARCHAR NOT NULL,
            role_key VARCHAR NOT NULL,
            sample_index INTEGER NOT NULL,
            call_ids VARCHAR[] NOT NULL,
            choice_indices INTEGER[] NOT NULL,
            token_ids INTEGER[] NOT NULL,
            loss_mask UTINYINT[] NOT NULL,
            logprobs FLOAT[] NOT NULL,
            n_tokens INTEGER NOT NULL,
            n_trainable INTEGER NOT NULL,
            reward DOUBLE,
            merge_version INTEGER NOT NULL,
            created_at TIMESTAMP NOT NULL
        );
        CREATE TABLE merge_breaks (
            run_id VARCHAR NOT NULL,
            episode_id VARCHAR NOT NULL,
            call_id VARCHAR NOT NULL,
            choice_index INTEGER NOT NULL,
            reason VARCHAR NOT NULL,
            position INTEGER,
            ours INTEGER[],
            theirs INTEGER[]
        );
        CREATE TABLE episode_merges (
            run_id VARCHAR NOT NULL,
            episode_id VARCHAR NOT NULL,
            n_calls INTEGER NOT NULL,
            n_followups INTEGER NOT NULL,
            n_samples INTEGER NOT NULL,
            per_call_tokens BIGINT NOT NULL,
            merged_tokens BIGINT NOT NULL,
            n_breaks INTEGER NOT NULL,
            n_drift INTEGER NOT NULL,
            merge_version INTEGER NOT NULL,
            created_at TIMESTAMP NOT NULL,
            PRIMARY KEY (run_id, episode_id)
        );
        CREATE VIEW merge_metrics AS
        SELECT run_id,
               count(*) AS episodes,
               CAST(sum(n_samples) AS BIGINT) AS samples,
               CAST(sum(n_calls) AS BIGINT) AS calls,
               CAST(sum(per_call_tokens) AS BIGINT) AS per_call_tokens,
               CAST(sum(merged_tokens) AS BIGINT) AS merged_tokens,
               CAST(sum(per_call_tokens) AS DOUBLE) / nullif(sum(merged_tokens), 0) AS merge_ratio,
               CAST(sum(n_drift) AS BIGINT) AS drift_calls,
               CAST(sum(n_followups) AS BIGINT) AS followup_calls,
               CAST(sum(n_drift) AS DOUBLE) / nullif(sum(n_followups), 0) AS drift_rate,
               count(*) FILTER (WHERE n_drift > 0) AS episodes_with_drift
        FROM episode_merges GROUP BY run_id;

        CREATE VIEW merge_reasons AS
        SELECT run_id, reason, count(*) AS n FROM merge_breaks GROUP BY run_id, reason;
        """,
    ),
    (
        "create_training_metrics",
        """
        CREATE TABLE metrics (
            run_id VARCHAR NOT NULL,
            step INTEGER NOT NULL,
            name VARCHAR NOT NULL,
            value DOUBLE,
            created_at TIMESTAMP NOT NULL
        );
        CREATE VIEW training_curve AS
        SELECT run_id, step, arg_max(value, created_at) FILTER (WHERE name = 'reward/mean') AS reward_mean,
               arg_max(value, created_at) FILTER (WHERE name = 'val/pass@n') AS val_pass_at_n,
               arg_max(value, created_at) FILTER (WHERE name = 'actor/kl') AS kl,
               arg_max(value, created_at) FILTER (WHERE name = 'actor/entropy') AS entropy,
               arg_max(value, created_at) FILTER (WHERE name = 'response/length_mean') AS response_length,
               arg_max(value, created_at) FILTER (WHERE name = 'time/step_s') AS step_s
        FROM metrics GROUP BY run_id, step;
        """,
    ),
    (
        "create_roles_view",
        """
        CREATE VIEW roles AS
        SELECT run_id, role_key,
               arg_min(requested_model, started_at) AS requested_model,
               arg_min(system_hash, started_at) AS system_hash,
               arg_min(tools_hash, started_at) AS tools_hash,
               count(*) AS calls,
               count(DISTINCT episode_id) AS episodes,
               arg_min(call_id, started_at) AS example_call_id,
               arg_min(left(json_extract_string(request, '$.messages[0].content'), 200), started_at)
                   AS first_message
        FROM calls WHERE role_key <> '' GROUP BY run_id, role_key;
        """,
    ),
    (
        "roles_view_names",
        """
        CREATE OR REPLACE VIEW roles AS
        SELECT run_id, role_key,
               arg_min(extra->>'role', started_at) AS role,
               arg_min(requested_model, started_at) AS requested_model,
               arg_min(system_hash, started_at) AS system_hash,
               arg_min(tools_hash, started_at) AS tools_hash,
               count(*) AS calls,
               count(DISTINCT episode_id) AS episodes,
               arg_min(coalesce(extra->>'upstream', 'policy'), started_at) AS served_by,
               arg_min(call_id, started_at) AS example_call_id,
               arg_min(left(json_extract_string(request, '$.messages[0].content'), 200), started_at)
                   AS first_message
        FROM calls WHERE role_key <> '' GROUP BY run_id, role_key;
        """,
    ),
    (
        # A primary-key index lives in memory whole (DuckDB cannot evict it) and grows ~0.15 kB with every call, so
        # a long-running proxy's memory grew without bound; call ids are unique by construction (uuid4), so the
        # two per-call tables are rebuilt without one. Views read them by name and need no change.
        "calls_without_primary_keys",
        """
        CREATE TABLE calls_unindexed (
            call_id VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            episode_id VARCHAR NOT NULL,
            call_index INTEGER NOT NULL,
            endpoint VARCHAR NOT NULL,
            stream BOOLEAN NOT NULL,
            requested_model VARCHAR,
            served_model VARCHAR,
            role_key VARCHAR NOT NULL,
            system_hash VARCHAR,
            tools_hash VARCHAR,
            request JSON NOT NULL USING COMPRESSION zstd,
            response JSON USING COMPRESSION zstd,
            prompt_ids INTEGER[],
            token_source VARCHAR NOT NULL,
            status VARCHAR NOT NULL,
            http_status INTEGER NOT NULL,
            error VARCHAR,
            started_at TIMESTAMP NOT NULL,
            latency_ms DOUBLE NOT NULL,
            ttft_ms DOUBLE,
            weight_version INTEGER NOT NULL,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            extra JSON
        );
        CREATE TABLE choices_unindexed (
            call_id VARCHAR NOT NULL,
            choice_index INTEGER NOT NULL,
            completion_ids INTEGER[],
            logprobs FLOAT[],
            finish_reason VARCHAR,
            text VARCHAR,
            tool_calls JSON,
            reasoning VARCHAR
        );
        INSERT INTO calls_unindexed SELECT * FROM calls;
        INSERT INTO choices_unindexed SELECT * FROM choices;
        DROP TABLE choices;
        DROP TABLE calls;
        ALTER TABLE calls_unindexed RENAME TO calls;
        ALTER TABLE choices_unindexed RENAME TO choices;
        """,
    ),
    (
        # What cut or flagged a call (proxy/guard.py writes calls.extra.flags), one row each; and every sample's
        # truncation reasons, so no truncated sample is silent. Samples merged before this migration have NULL.
        "flags_and_sample_truncation",
        """
        ALTER TABLE samples ADD COLUMN truncation VARCHAR[];
        CREATE VIEW flags AS
        SELECT c.run_id, c.episode_id, c.call_id, c.call_index,
               CAST(f->>'choice' AS INTEGER) AS choice_index, f->>'kind' AS kind, f->>'reason' AS reason,
               CAST(f->>'value' AS DOUBLE) AS value, CAST(f->>'threshold' AS DOUBLE) AS threshold
        FROM calls AS c, unnest(CAST(c.extra->'flags' AS JSON[])) AS t(f);
        """,
    ),
    (
        # The same rows, unnested per call: a filter on the calls' columns (one episode's flags, as the proxy asks
        # when an episode comes back to it) now reads those calls alone, not every call's flags (10x at 200k calls).
        "flags_unnested_per_call",
        """
        CREATE OR REPLACE VIEW flags AS
        SELECT run_id, episode_id, call_id, call_index,
               CAST(f->>'choice' AS INTEGER) AS choice_index, f->>'kind' AS kind, f->>'reason' AS reason,
               CAST(f->>'value' AS DOUBLE) AS value, CAST(f->>'threshold' AS DOUBLE) AS threshold
        FROM (SELECT run_id, episode_id, call_id, call_index, unnest(CAST(extra->'flags' AS JSON[])) AS f FROM calls);
        """,
    ),
    (
        # A sub-agent's timeline names the call and tool call that started it (merge version 4). Breaks written
        # before have NULL there.
        "sub_agent_parents",
        """
        ALTER TABLE merge_breaks ADD COLUMN parent_call_id VARCHAR;
        ALTER TABLE merge_breaks ADD COLUMN parent_tool_call_id VARCHAR;
        """,
    ),
    (
        # One policy per trained role (proxy/roles.py): each call says which role rule it matched and which policy
        # served it, in columns a trainer filters on. Calls recorded before get their role from extra.role (still
        # written, for SQL that reads it) and a NULL policy: which policy served them was not recorded.
        "calls_role_and_policy",
        """
        ALTER TABLE calls ADD COLUMN role VARCHAR;
        ALTER TABLE calls ADD COLUMN policy VARCHAR;
        UPDATE calls SET role = extra->>'role' WHERE extra->>'role' IS NOT NULL;
        CREATE OR REPLACE VIEW roles AS
        SELECT run_id, role_key,
               arg_min(role, started_at) AS role,
               arg_min(requested_model, started_at) AS requested_model,
               arg_min(system_hash, started_at) AS system_hash,
               arg_min(tools_hash, started_at) AS tools_hash,
               count(*) AS calls,
               count(DISTINCT episode_id) AS episodes,
               arg_min(coalesce(extra->>'upstream', 'policy'), started_at) AS served_by,
               arg_min(call_id, started_at) AS example_call_id,
               arg_min(left(json_extract_string(request, '$.messages[0].content'), 200), started_at)
                   AS first_message,
               arg_min(policy, started_at) AS policy
        FROM calls WHERE role_key <> '' GROUP BY run_id, role_key;
        """,
    ),
    (
        # A sandboxed episode (harness/sandbox/) says where it ran and what its sandbox flagged; NULL otherwise.
        "episode_outcomes_sandbox",
        """
        ALTER TABLE episode_outcomes ADD COLUMN sandbox JSON;
        """,
    ),
]
SCHEMA_VERSION = len(MIGRATIONS)
