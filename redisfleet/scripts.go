package redisfleet

import "github.com/redis/go-redis/v9"

// The shared breaker of a scope is one Redis hash, changed only by these
// scripts, so each change is atomic and timed by Redis's clock (TIME), not
// the replicas'. Fields:
//
//	st  "c" closed or "o" open (missing: closed)
//	f   consecutive failed calls, while closed
//	u   end of the open period, ms on Redis's clock
//	g   generation: a new one at every transition
//	p   probe leases granted in this open period
//	s   probe successes in this open period
//	l   when the last lease lapses, ms
//
// Every script returns {state, remaining ms, generation}, state being
// "calm", "suspect", "open" or, from probe, "granted" or "taken"; a
// transition is published on the fleet's channel as
// "scope\nstate\nremaining ms". Every write renews the hash's expiry, so
// the state of a fleet that stopped calling (a replica that died) expires.
const lib = `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(k, field)
  return tonumber(redis.call('HGET', k, field) or '0') or 0
end

local function view(k, now)
  if redis.call('HGET', k, 'st') == 'o' then
    return {'open', math.max(num(k, 'u') - now, 0), num(k, 'g')}
  end
  if num(k, 'f') > 0 then
    return {'suspect', 0, num(k, 'g')}
  end
  return {'calm', 0, num(k, 'g')}
end

local function publish(k, now, channel, scope)
  local v = view(k, now)
  redis.call('PUBLISH', channel, scope .. '\n' .. v[1] .. '\n' .. v[2])
  return v
end

local function open(k, now, open_ms)
  redis.call('HSET', k, 'st', 'o', 'f', 0, 'u', now + open_ms, 'p', 0, 's', 0, 'l', 0)
  redis.call('HINCRBY', k, 'g', 1)
end

local function close(k)
  redis.call('HSET', k, 'st', 'c', 'f', 0, 'p', 0, 's', 0, 'l', 0)
  redis.call('HINCRBY', k, 'g', 1)
end
`

// ARGV of every script: channel, scope, ttl ms, threshold, open ms, max
// probes; then the script's own.
const header = `
local k, channel, scope = KEYS[1], ARGV[1], ARGV[2]
local ttl, threshold, open_ms, max_probes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
`

var (
	// read returns the state.
	readScript = redis.NewScript(lib + header + `
return view(k, now)
`)

	// failed counts a failed call; the one that reaches the threshold opens
	// the breaker. The first failure of a run makes the fleet suspect.
	failedScript = redis.NewScript(lib + header + `
if redis.call('HGET', k, 'st') == 'o' then
  return view(k, now)
end
local f = redis.call('HINCRBY', k, 'f', 1)
redis.call('PEXPIRE', k, ttl)
if f >= threshold then
  open(k, now, open_ms)
  redis.call('PEXPIRE', k, ttl)
  return publish(k, now, channel, scope)
end
if f == 1 then
  return publish(k, now, channel, scope)
end
return view(k, now)
`)

	// recovered ends the run of failures of a closed breaker.
	recoveredScript = redis.NewScript(lib + header + `
if redis.call('HGET', k, 'st') ~= 'o' and num(k, 'f') > 0 then
  redis.call('HSET', k, 'f', 0)
  redis.call('PEXPIRE', k, ttl)
  return publish(k, now, channel, scope)
end
return view(k, now)
`)

	// probe grants one of max_probes leases once the open period is over.
	// A lease lapses after lease_ms (ARGV[7]): a probe whose replica died
	// frees the period for another.
	probeScript = redis.NewScript(lib + header + `
local lease_ms = tonumber(ARGV[7])
if redis.call('HGET', k, 'st') ~= 'o' then
  return view(k, now)
end
if now < num(k, 'u') then
  return view(k, now)
end
local p = num(k, 'p')
if p >= max_probes and now >= num(k, 'l') then
  p = 0
  redis.call('HSET', k, 's', 0)
end
if p >= max_probes then
  return {'taken', 0, num(k, 'g')}
end
redis.call('HSET', k, 'p', p + 1, 'l', now + lease_ms)
redis.call('PEXPIRE', k, ttl)
return {'granted', 0, num(k, 'g')}
`)

	// probeDone records a probe's verdict (ARGV[7] generation, ARGV[8]
	// "s", "f" or "i"): max_probes successes close the breaker, a failure
	// opens it again, an ignored probe hands its lease back.
	probeDoneScript = redis.NewScript(lib + header + `
local gen, verdict = tonumber(ARGV[7]), ARGV[8]
if redis.call('HGET', k, 'st') ~= 'o' or num(k, 'g') ~= gen then
  return view(k, now)
end
redis.call('PEXPIRE', k, ttl)
if verdict == 'f' then
  open(k, now, open_ms)
  return publish(k, now, channel, scope)
end
if verdict == 'i' then
  redis.call('HSET', k, 'p', math.max(num(k, 'p') - 1, 0))
  return view(k, now)
end
local s = redis.call('HINCRBY', k, 's', 1)
if s >= max_probes then
  close(k)
  return publish(k, now, channel, scope)
end
return view(k, now)
`)
)
