-- agent_events are the life of each agent's sandbox, as its followers read
-- it: created, ready, idle stops and resumes, pods replaced or failed,
-- commands started and ended, egress denied, errors. seq numbers an
-- agent's events from 1 up, with no gaps, and is the id a follower resumes
-- from. agent_event_heads keeps each agent's last number: appending takes
-- the next numbers by updating the agent's row, which serialises the
-- writers of one agent (the controller on the leader, the Compute API on
-- every replica) and keeps numbering on after retention deleted every
-- event of an agent, so that a follower's id never names an older event.
-- source_key, when set, is unique for the agent: a writer that may see a
-- thing twice (a Kubernetes Event, by its UID) records it once.

-- +goose Up
CREATE TABLE agent_event_heads (
    agent_id TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL CHECK (last_seq >= 0)
);

CREATE TABLE agent_events (
    agent_id   TEXT NOT NULL,
    seq        INTEGER NOT NULL CHECK (seq >= 1),
    type       TEXT NOT NULL,
    namespace  TEXT NOT NULL,
    sandbox    TEXT NOT NULL,
    data       TEXT NOT NULL,
    at         TIMESTAMP NOT NULL,
    source_key TEXT,
    PRIMARY KEY (agent_id, seq)
);

CREATE UNIQUE INDEX agent_events_source ON agent_events (agent_id, source_key) WHERE source_key IS NOT NULL;
CREATE INDEX agent_events_at ON agent_events (at);

-- +goose Down
DROP TABLE agent_events;
DROP TABLE agent_event_heads;
