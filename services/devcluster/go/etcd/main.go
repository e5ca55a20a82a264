// The etcd server the tests' control plane stores in: upstream's own entry point, at the pinned release.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
