// Package conformance holds only tests: grpc-go's interop client cases
// (google.golang.org/grpc/interop), run against grpc-go's interop test
// server over TCP on 127.0.0.1, without herdguard as the control and
// through herdguard's interceptors with the default and a one-byte stream
// buffer, each with tracing off and on. Every case must pass through
// herdguard exactly as it passes without it.
//
// The interop cases report a failure with grpclog's Fatal, which ends the
// process; TestMain installs a grpclog logger that fails the running test
// instead.
//
// It is a module of its own so that the interop package's dependencies
// (OAuth, xDS, GCE metadata) stay out of herdguard's go.mod.
package conformance
