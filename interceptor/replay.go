package interceptor

import (
	"github.com/herdguard/herdguard/internal/errs"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// defaultStreamBuffer is how many bytes of sent messages a stream keeps for
// replay until it commits: 256 KiB, as gRPC's own retry keeps.
const defaultStreamBuffer = 256 << 10

// frameHeader is the length prefix gRPC puts before every message; the
// replay buffer counts it, as gRPC's own does.
const frameHeader = 5

// replayBuffer is a stream's replay buffer: every message sent before the
// stream commits, encoded back to back in buf (ends[i] is where message i
// ends), all of type msgType, plus frameHeader bytes each in size. A new
// attempt takes them again, in order. It is guarded by the stream's lock.
type replayBuffer struct {
	buf     []byte
	ends    []int
	size    int
	msgType protoreflect.MessageType
	// The buffer starts in these, so that a stream that sends one small
	// request, as every server stream does, keeps it without allocating.
	bufInline  [64]byte
	endsInline [2]int
}

// add keeps a copy of m if it fits within limit bytes. It reports false
// when m cannot be kept: it is not a protobuf message, not of the type of
// those before it, or it outgrows the buffer. The buffer then keeps what it
// had.
func (b *replayBuffer) add(m any, limit int) bool {
	pm, ok := m.(proto.Message)
	if !ok {
		return false // only protobuf messages can be encoded here
	}
	t := pm.ProtoReflect().Type()
	if b.msgType == nil {
		b.msgType = t
	} else if t != b.msgType {
		return false
	}
	if b.ends == nil {
		b.buf, b.ends = b.bufInline[:0], b.endsInline[:0]
	}
	start := len(b.buf)
	buf, err := proto.MarshalOptions{}.MarshalAppend(b.buf, pm)
	if err != nil || b.size+len(buf)-start+frameHeader > limit {
		b.buf = buf[:start]
		return false
	}
	b.buf = buf
	b.ends = append(b.ends, len(buf))
	b.size += len(buf) - start + frameHeader
	return true
}

// len returns how many messages the buffer keeps.
func (b *replayBuffer) len() int { return len(b.ends) }

// message decodes message i into a new message of the caller's type, and
// returns it with its encoded size.
func (b *replayBuffer) message(i int) (proto.Message, int, error) {
	start := 0
	if i > 0 {
		start = b.ends[i-1]
	}
	msg := b.msgType.New().Interface()
	if err := proto.Unmarshal(b.buf[start:b.ends[i]], msg); err != nil {
		return nil, 0, status.Errorf(codes.Internal, "herdguard: replaying a buffered message: %v", err)
	}
	return msg, b.ends[i] - start, nil
}

// release drops every message: the stream committed or ended.
func (b *replayBuffer) release() { b.buf, b.ends, b.size = nil, nil, 0 }

// bufferLocked keeps a copy of m, just sent, for replay while the stream
// is open. It reports false for a message that cannot be kept, or that
// outgrows the buffer: the stream must commit.
func (s *clientStream) bufferLocked(m any) bool {
	return !s.state.isOpen() || s.replay.add(m, s.limit)
}

// streamBufferFor returns the replay buffer limit of a call.
func streamBufferFor(def int, opts []grpc.CallOption) (int, error) {
	for _, o := range opts {
		if o, ok := o.(streamBufferOption); ok {
			if o.n < 0 {
				return 0, errs.Errorf("interceptor: CallStreamBuffer(%d): must not be negative", o.n)
			}
			def = o.n
		}
	}
	return def, nil
}
