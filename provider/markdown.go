package provider

import "strings"

// Helpers that write lists of names into attribute descriptions, so that a
// description quotes the same list a validator checks against.

// codeList renders names as "`a`", "`a` and `b`" or "`a`, `b` and `c`".
func codeList(names []string) string {
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = "`" + n + "`"
	}
	if len(quoted) < 2 {
		return strings.Join(quoted, "")
	}
	return strings.Join(quoted[:len(quoted)-1], ", ") + " and " + quoted[len(quoted)-1]
}

// codeAlternatives renders names as "`a`", "`a` or `b`" or "`a`, `b` or `c`".
func codeAlternatives(names []string) string {
	list := codeList(names)
	if i := strings.LastIndex(list, " and "); i >= 0 {
		list = list[:i] + " or " + list[i+len(" and "):]
	}
	return list
}
