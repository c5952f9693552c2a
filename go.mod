module github.com/herdguard/herdguard

go 1.26.0

require (
	github.com/sony/gobreaker/v2 v2.4.0
	google.golang.org/grpc v1.85.0
)

require (
	golang.org/x/sys v0.48.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260928230214-8a89bd6388cc // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
