'use strict';
// A Node client of pyscore.v1 (@grpc/grpc-js + @grpc/proto-loader) for tests/clients/test_node_client.py: reads a
// plan (JSON) on stdin, runs it against $PYSCORE_TARGET and prints what came back as one JSON object. The
// Python test sends the same requests through the Python client and compares, bit for bit.
//
// plan: {score: [ScoreRequest...], stream: GenerateRequest, invalid: ScoreRequest, deadline: {request, ms}}
// out:  {score: [ScoreResponse...], stream: [GenerateResponse...], invalid: {code, details, violations},
//        deadline: {code, details}}
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const googleProtos = require('google-proto-files');

const ROOT = path.resolve(__dirname, '..', '..', '..');
// The options docs/clients.md gives: the .proto's field names, enum names as strings, exact int64, defaults filled.
const LOADER = {keepCase: true, enums: String, longs: String, defaults: true, includeDirs: [path.join(ROOT, 'proto')]};
const {pyscore} = grpc.loadPackageDefinition(protoLoader.loadSync('pyscore/v1/scorer.proto', LOADER));
const rpc = new protobuf.Root().loadSync(
  [googleProtos.getProtoPath('rpc', 'status.proto'), googleProtos.getProtoPath('rpc', 'error_details.proto')],
  {keepCase: true});

function fieldViolations(err) {
  const [bytes] = err.metadata ? err.metadata.get('grpc-status-details-bin') : [];
  if (!bytes) return [];
  return rpc.lookupType('google.rpc.Status').decode(bytes).details
    .filter((any) => any.type_url === 'type.googleapis.com/google.rpc.BadRequest')
    .flatMap((any) => rpc.lookupType('google.rpc.BadRequest').decode(any.value).field_violations)
    .map((v) => ({field: v.field, description: v.description}));
}

const client = new pyscore.v1.Scorer(process.env.PYSCORE_TARGET, grpc.credentials.createInsecure());
const seconds = (s) => ({deadline: Date.now() + s * 1000});

function unary(method, request, options) {
  return new Promise((resolve, reject) => client[method](request, options, (err, response) => (
    err ? reject(err) : resolve(response))));
}

function stream(request, options) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    const call = client.GenerateStream(request, options);
    call.on('data', (chunk) => chunks.push(chunk));
    call.on('error', reject);
    call.on('end', () => resolve(chunks));
  });
}

async function failure(promise) {
  try {
    await promise;
  } catch (err) {
    return {code: grpc.status[err.code], details: err.details, violations: fieldViolations(err)};
  }
  throw new Error('the call succeeded but should have failed');
}

async function main(plan) {
  const out = {score: []};
  for (const request of plan.score) out.score.push(await unary('Score', request, seconds(60)));
  out.stream = await stream(plan.stream, seconds(60));
  out.invalid = await failure(unary('Score', plan.invalid, seconds(60)));
  out.deadline = await failure(stream(plan.deadline.request, {deadline: Date.now() + plan.deadline.ms}));
  return out;
}

let input = '';
process.stdin.on('data', (data) => { input += data; });
process.stdin.on('end', () => main(JSON.parse(input)).then(
  (out) => { console.log(JSON.stringify(out)); client.close(); },
  (err) => { console.error(err); process.exit(1); }));
