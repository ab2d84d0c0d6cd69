// pause: the sandbox ("infrastructure") container of every pod on the test cluster, because no
// registry with the upstream pause image is reachable here. It holds the pod's namespaces open,
// reaps zombies (it is PID 1 when the pod shares its process namespace) and exits on SIGINT or
// SIGTERM - the same contract as Kubernetes' own pause.c, written here in Go so it builds with
// the Go toolchain the Kubernetes build already installs (CGO_ENABLED=0: a static binary).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
