package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/yaml"
)

// ApplyCRDs creates or updates every CRD in the YAML files matching glob
// and waits until they are Established. Test packages share one cluster and
// may apply the same CRDs at once, so conflicts are retried.
func ApplyCRDs(ctx context.Context, cfg *rest.Config, glob string) error {
	files, err := filepath.Glob(glob)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no CRD files match %s", glob)
	}
	cs, err := apiextclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	crds := cs.ApiextensionsV1().CustomResourceDefinitions()
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		var crd apiextv1.CustomResourceDefinition
		if err := yaml.UnmarshalStrict(b, &crd); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		err = retry.OnError(retry.DefaultRetry, func(err error) bool {
			return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)
		}, func() error {
			live, err := crds.Get(ctx, crd.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				_, err = crds.Create(ctx, &crd, metav1.CreateOptions{})
				return err
			}
			if err != nil {
				return err
			}
			crd.ResourceVersion = live.ResourceVersion
			_, err = crds.Update(ctx, &crd, metav1.UpdateOptions{})
			return err
		})
		if err != nil {
			return fmt.Errorf("apply %s: %w", crd.Name, err)
		}
		err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
			live, err := crds.Get(ctx, crd.Name, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			for _, c := range live.Status.Conditions {
				if c.Type == apiextv1.Established && c.Status == apiextv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("CRD %s not Established: %w", crd.Name, err)
		}
	}
	return nil
}
