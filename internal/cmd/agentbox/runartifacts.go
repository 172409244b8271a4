package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// stringsFlag is a repeatable string flag.
type stringsFlag struct{ v *[]string }

func (f stringsFlag) String() string {
	if f.v == nil {
		return ""
	}
	return strings.Join(*f.v, ",")
}

func (f stringsFlag) Set(s string) error {
	*f.v = append(*f.v, s)
	return nil
}

func (o *runOptions) artifactsCommand() command {
	var get, out string
	return command{
		synopsis: "runs artifacts [--get PATH [-o FILE]] [--json] RUN_ID",
		doc: `Lists a run's artifacts: the files its command left under its artifact
paths (runs start --artifact; /workspace/artifacts by default), kept in the
platform's object store once the command ended. Each is listed with its
size and SHA-256, or with why it was not kept (over a size limit). With
--get PATH, agentbox downloads the artifact at PATH (as listed) to stdout,
or to FILE with -o, checks its SHA-256 against the one the API recorded,
and exits 1 if they differ (a FILE is then removed).`,
		args: []string{"RUN_ID"},
		flags: func(fs *flag.FlagSet) {
			fs.StringVar(&get, "get", "", "download the artifact at this path")
			fs.StringVar(&out, "o", "", "with --get, write the artifact to this file instead of stdout")
			fs.BoolVar(&o.asJSON, "json", false, "print the list as JSON")
		},
		check: func([]string) error {
			switch {
			case out != "" && get == "":
				return fmt.Errorf("-o goes with --get")
			case get != "" && o.asJSON:
				return fmt.Errorf("--json lists; it does not go with --get")
			}
			return nil
		},
		run: func(ctx context.Context, c *client.Client, args []string) error {
			if get != "" {
				return o.downloadArtifact(ctx, c, args[0], get, out)
			}
			l, err := c.ListRunArtifacts(ctx, args[0])
			if err != nil {
				return err
			}
			if o.asJSON {
				return printJSON(o.stdout, l)
			}
			tw := tabwriter.NewWriter(o.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "PATH\tSIZE\tSHA256\tUPLOADED")
			for _, a := range l.Artifacts {
				if a.Error != "" {
					fmt.Fprintf(tw, "%s\t%d\t-\t%s\n", a.Path, a.Size, a.Error)
					continue
				}
				at := "-"
				if a.UploadedAt != nil {
					at = a.UploadedAt.Format(time.RFC3339)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", a.Path, a.Size, a.SHA256, at)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			if l.State != client.RunArtifactsCollected || l.Message != "" {
				msg := "artifacts " + l.State
				if l.Message != "" {
					msg += ": " + l.Message
				}
				fmt.Fprintf(o.stderr, "agentbox: %s\n", msg)
			}
			return nil
		},
	}
}

// downloadArtifact copies one artifact to out (stdout when empty),
// checking its digest; a file whose digest does not match is removed.
func (o *runOptions) downloadArtifact(ctx context.Context, c *client.Client, id, path, out string) (err error) {
	body, a, err := c.GetRunArtifact(ctx, id, path)
	if err != nil {
		return err
	}
	defer body.Close()
	w := o.stdout
	if out != "" {
		tmp, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".*")
		if err != nil {
			return err
		}
		defer func() {
			if cerr := tmp.Close(); err == nil {
				err = cerr
			}
			if err == nil {
				err = os.Rename(tmp.Name(), out)
			}
			if err != nil {
				_ = os.Remove(tmp.Name())
			}
		}()
		w = tmp
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(w, h), body)
	if err != nil {
		return fmt.Errorf("download %s: %w", path, err)
	}
	if n != a.Size {
		return fmt.Errorf("download %s: got %d bytes of %d", path, n, a.Size)
	}
	if got := hex.EncodeToString(h.Sum(nil)); a.SHA256 != "" && got != a.SHA256 {
		return errors.New("download " + path + ": its SHA-256 is " + got + ", the run recorded " + a.SHA256)
	}
	return nil
}
