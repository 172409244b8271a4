package redact

import (
	"context"
	"log/slog"
)

// SlogHandler returns a handler that passes records to h with
// secrets redacted from the message and from every attribute, at any
// depth of groups. Errors, Stringers and other values are redacted in
// their printed form, which is how a text or JSON handler would show
// them anyway.
func SlogHandler(h slog.Handler) slog.Handler { return &redactingHandler{h: h} }

type redactingHandler struct{ h slog.Handler }

func (r *redactingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return r.h.Enabled(ctx, l)
}

func (r *redactingHandler) Handle(ctx context.Context, rec slog.Record) error {
	out := slog.NewRecord(rec.Time, rec.Level, String(rec.Message), rec.PC)
	rec.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(redactAttr(a))
		return true
	})
	return r.h.Handle(ctx, out)
}

func (r *redactingHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(attrs))
	for i, a := range attrs {
		red[i] = redactAttr(a)
	}
	return &redactingHandler{h: r.h.WithAttrs(red)}
}

func (r *redactingHandler) WithGroup(name string) slog.Handler {
	return &redactingHandler{h: r.h.WithGroup(name)}
}

func redactAttr(a slog.Attr) slog.Attr {
	a.Value = a.Value.Resolve()
	switch a.Value.Kind() {
	case slog.KindString:
		a.Value = slog.StringValue(String(a.Value.String()))
	case slog.KindGroup:
		group := a.Value.Group()
		red := make([]slog.Attr, len(group))
		for i, g := range group {
			red[i] = redactAttr(g)
		}
		a.Value = slog.GroupValue(red...)
	case slog.KindAny:
		// Values with nothing to hide keep their type, so a handler can
		// still render a slice or map as structure.
		if red, changed := value(a.Value.Any()); changed {
			a.Value = slog.StringValue(red.(string))
		}
	}
	return a
}
