package chart

import (
	"sync"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// restClientGetter adapts a *rest.Config to the RESTClientGetter Helm's
// kube client is built on. Helm normally derives one from kubeconfig flags;
// the provider has already resolved its connection into a *rest.Config
// (possibly without any kubeconfig file), so it hands that over unchanged.
type restClientGetter struct {
	cfg       *rest.Config
	namespace string

	once      sync.Once
	discovery discovery.CachedDiscoveryInterface
	mapper    meta.ResettableRESTMapper
	err       error
}

var _ genericclioptions.RESTClientGetter = (*restClientGetter)(nil)

func newRESTClientGetter(cfg *rest.Config, namespace string) *restClientGetter {
	c := rest.CopyConfig(cfg)
	// Helm creates and waits on many objects at once; client-go's default of
	// 5 queries per second would make an install crawl.
	if c.QPS == 0 {
		c.QPS = 50
		c.Burst = 100
	}
	return &restClientGetter{cfg: c, namespace: namespace}
}

func (g *restClientGetter) ToRESTConfig() (*rest.Config, error) { return rest.CopyConfig(g.cfg), nil }

func (g *restClientGetter) init() {
	g.once.Do(func() {
		dc, err := discovery.NewDiscoveryClientForConfig(g.cfg)
		if err != nil {
			g.err = err
			return
		}
		g.discovery = memory.NewMemCacheClient(dc)
		g.mapper = restmapper.NewDeferredDiscoveryRESTMapper(g.discovery)
	})
}

func (g *restClientGetter) ToDiscoveryClient() (discovery.CachedDiscoveryInterface, error) {
	g.init()
	return g.discovery, g.err
}

func (g *restClientGetter) ToRESTMapper() (meta.RESTMapper, error) {
	g.init()
	if g.err != nil {
		return nil, g.err
	}
	return restmapper.NewShortcutExpander(g.mapper, g.discovery, nil), nil
}

// resetMapper forgets discovered kinds, for after CRDs were installed.
func (g *restClientGetter) resetMapper() {
	g.init()
	if g.mapper != nil {
		g.mapper.Reset()
	}
}

// ToRawKubeConfigLoader only serves the namespace: Helm's kube client asks
// it for the default namespace of objects that name none.
func (g *restClientGetter) ToRawKubeConfigLoader() clientcmd.ClientConfig {
	return clientcmd.NewDefaultClientConfig(*clientcmdapi.NewConfig(), &clientcmd.ConfigOverrides{
		Context: clientcmdapi.Context{Namespace: g.namespace},
	})
}
