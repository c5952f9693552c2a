package interceptor

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"math/rand/v2"
	"strings"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// safeToRetry reports whether a method's registered descriptor says it may
// be repeated: idempotency_level IDEMPOTENT or NO_SIDE_EFFECTS. The answer
// is looked up once per method.
func (ic *Interceptor) safeToRetry(method string) bool {
	return ic.idempotent.Get(method, func() bool { return idempotentMethod(method) })
}

func idempotentMethod(method string) bool {
	name := strings.Replace(strings.TrimPrefix(method, "/"), "/", ".", 1)
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(name))
	if err != nil {
		return false
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return false
	}
	opts, ok := md.Options().(*descriptorpb.MethodOptions)
	if !ok || opts == nil {
		return false
	}
	switch opts.GetIdempotencyLevel() {
	case descriptorpb.MethodOptions_IDEMPOTENT, descriptorpb.MethodOptions_NO_SIDE_EFFECTS:
		return true
	}
	return false
}

// withIdempotencyKey adds a fresh idempotency key to a call's outgoing
// metadata, when that option is on.
func (ic *Interceptor) withIdempotencyKey(ctx context.Context) context.Context {
	if ic.idempotencyKey == "" {
		return ctx
	}
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], rand.Uint64())
	binary.LittleEndian.PutUint64(b[8:], rand.Uint64())
	return metadata.AppendToOutgoingContext(ctx, ic.idempotencyKey, hex.EncodeToString(b[:]))
}
