package archive

import "github.com/agentbox/terraform-provider-agentbox/internal/objectstore"

// Kinds of object store, as Driver.Store reports them.
const (
	// StoreS3 is an S3-compatible bucket (Config.Endpoint).
	StoreS3 = objectstore.KindS3
	// StoreEmbedded is a directory on a volume of the control plane
	// (Config.Dir): the chart's default, which needs nothing outside the
	// cluster.
	StoreEmbedded = objectstore.KindEmbedded
)
