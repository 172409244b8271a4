package redact

import (
	"fmt"
	"time"

	"github.com/go-logr/logr"
)

// Logger returns l with secrets redacted from every message, value and
// error before its sink sees them. Errors and Stringers are redacted in
// their printed form, which is how a log shows them anyway; values with
// nothing to hide keep their type, so that a structured sink still
// renders them as structure.
func Logger(l logr.Logger) logr.Logger {
	sink := l.GetSink()
	if sink == nil {
		return l
	}
	if _, ok := sink.(*logSink); ok {
		return l
	}
	// The wrapper is one more frame between the caller and the sink,
	// which a sink that reports callers must skip.
	if cd, ok := sink.(logr.CallDepthLogSink); ok {
		sink = cd.WithCallDepth(1)
	}
	return l.WithSink(&logSink{sink: sink})
}

type logSink struct{ sink logr.LogSink }

func (s *logSink) Init(info logr.RuntimeInfo) {
	info.CallDepth++
	s.sink.Init(info)
}

func (s *logSink) Enabled(level int) bool { return s.sink.Enabled(level) }

func (s *logSink) Info(level int, msg string, kv ...any) {
	s.sink.Info(level, String(msg), values(kv)...)
}

func (s *logSink) Error(err error, msg string, kv ...any) {
	s.sink.Error(redactError(err), String(msg), values(kv)...)
}

func (s *logSink) WithValues(kv ...any) logr.LogSink {
	return &logSink{sink: s.sink.WithValues(values(kv)...)}
}

func (s *logSink) WithName(name string) logr.LogSink { return &logSink{sink: s.sink.WithName(name)} }

func (s *logSink) WithCallDepth(depth int) logr.LogSink {
	if cd, ok := s.sink.(logr.CallDepthLogSink); ok {
		return &logSink{sink: cd.WithCallDepth(depth)}
	}
	return s
}

// values redacts the values of key-value pairs; keys are the program's
// own names.
func values(kv []any) []any {
	var out []any
	for i := 1; i < len(kv); i += 2 {
		v, changed := value(kv[i])
		if !changed {
			continue
		}
		if out == nil {
			out = append([]any(nil), kv...)
		}
		out[i] = v
	}
	if out == nil {
		return kv
	}
	return out
}

// value returns v redacted, and whether that changed anything.
func value(v any) (any, bool) {
	var s string
	switch v := v.(type) {
	case nil, bool, int, int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64, float32, float64,
		time.Duration, time.Time:
		return v, false
	case string:
		s = v
	case error:
		s = v.Error()
	case fmt.Stringer:
		s = v.String()
	default:
		s = fmt.Sprint(v)
	}
	if red := String(s); red != s {
		return red, true
	}
	return v, false
}

// redactedError stands in for an error whose message held a secret.
type redactedError string

func (e redactedError) Error() string { return string(e) }

func redactError(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if red := String(msg); red != msg {
		return redactedError(red)
	}
	return err
}
