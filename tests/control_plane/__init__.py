"""The tests' real Kubernetes control plane: etcd and kube-apiserver built from pinned Go modules, started per session."""
