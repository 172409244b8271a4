-- A RunSchedule's runs carry its namespace/name in runs.schedule (a column
-- since the runs table was made). Listing them, finding the live ones and
-- trimming the finished ones to the schedule's history limits read by
-- schedule, newest first.

-- +goose Up
CREATE INDEX runs_schedule ON runs (schedule, created_at DESC, id DESC) WHERE schedule <> '';

-- +goose Down
DROP INDEX runs_schedule;
