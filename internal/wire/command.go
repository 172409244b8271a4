package wire

// ContentTypeNDJSON labels streamed responses: one JSON value a line.
const ContentTypeNDJSON = "application/x-ndjson"

// Streams a CommandEvent can carry output from.
const (
	StreamStdout = "stdout"
	StreamStderr = "stderr"
)

// CommandRequest runs Command[0] with arguments Command[1:]. No shell is
// involved unless the caller runs one, e.g. ["sh", "-c", "..."]. It is the
// body of the API's run_command and of the supervisor's /v1/commands: the
// API passes it on as it came.
type CommandRequest struct {
	Command []string `json:"command"`
	// Cwd must be an existing directory. Empty means the supervisor's
	// default (/workspace in a sandbox); a relative path is taken relative
	// to that default.
	Cwd string `json:"cwd,omitempty"`
	// Env is merged over a minimal base environment (PATH, HOME, LANG and
	// the proxy variables); the supervisor's own environment is never
	// passed on.
	Env map[string]string `json:"env,omitempty"`
	// Stdin is written to the command's standard input, which is then
	// closed. Empty means /dev/null.
	Stdin string `json:"stdin,omitempty"`
	// TimeoutSeconds: 0 means the supervisor's default (60 s); above the
	// supervisor's maximum (10 minutes unless configured) is an
	// invalid_argument error. On timeout the whole process group is
	// killed and the result has TimedOut set; it is not an error.
	TimeoutSeconds int `json:"timeout_seconds,omitempty"`
	// MaxOutputBytes caps stdout and stderr combined. 0 means 1 MiB;
	// above the supervisor's limit is an invalid_argument error.
	MaxOutputBytes int64 `json:"max_output_bytes,omitempty"`
}

// CommandResult is the outcome of a command that was started, as the
// supervisor sends it. A non-zero exit, a signal or a timeout is a result,
// not an error.
//
// The Compute API's result (computeapi/client.CommandResult) has exactly
// these fields, converted one to the other, so a field added to one and not
// the other does not compile. It is a type of its own only because the API
// always sends out_of_memory (its OpenAPI document requires the field)
// while the supervisor sends it only when set; both encodings are kept as
// they are.
type CommandResult struct {
	// Stdout and Stderr are UTF-8; invalid bytes are replaced by U+FFFD.
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
	// ExitCode is -1 when the process was ended by a signal.
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended the process, e.g. "SIGKILL", or
	// is empty.
	Signal string `json:"signal"`
	// TimedOut means the supervisor killed the process group because the
	// timeout expired.
	TimedOut bool `json:"timed_out"`
	// OutOfMemory means the supervisor killed the process group because
	// the sandbox neared its memory limit and this command held the most.
	OutOfMemory bool `json:"out_of_memory,omitempty"`
	// Truncated means output beyond MaxOutputBytes was discarded.
	Truncated  bool  `json:"truncated"`
	DurationMS int64 `json:"duration_ms"`
}

// CommandEvent is one line of a streamed command's response (the API's
// run_command_stream, the supervisor's /v1/commands/stream), with the
// Result and Peer of its side. Exactly one of its groups of fields is set:
//
//   - Stream and Data: output, in the order the supervisor read it.
//   - Truncated: the output cap was reached; nothing more is sent until
//     Exit.
//   - Exit: the command ended; it is the last event. Its Stdout and Stderr
//     are empty, since the output was sent as events.
//   - Error: the call failed after the stream had started (the supervisor
//     never does for a command that ran, whatever its outcome); it is the
//     last event.
//
// Data is UTF-8 text, as CommandResult's fields are: each invalid byte
// becomes U+FFFD. A character split between two reads of the pipe is held
// back until it is complete, so splitting never makes a valid character
// invalid. Text was preferred to base64 so that a caller can show output as
// it comes without decoding it; programs whose output is binary belong in
// a file that is then read.
type CommandEvent[Result any, P Peer] struct {
	Stream    string    `json:"stream,omitempty"`
	Data      string    `json:"data,omitempty"`
	Truncated bool      `json:"truncated,omitempty"`
	Exit      *Result   `json:"exit,omitempty"`
	Error     *Error[P] `json:"error,omitempty"`
}
