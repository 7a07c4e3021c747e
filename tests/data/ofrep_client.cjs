// OpenFeature's JavaScript server SDK with its OFREP provider, against `gatekeeper flags serve`.
//   node ofrep_client.cjs BASE_URL FLAG...   (the packages are found through NODE_PATH)
// Prints one JSON line: per flag the SDK's boolean and string evaluation details, and a bulk poll made
// twice through OFREP's own JavaScript API (@openfeature/ofrep-core), the second with If-None-Match.
const { OpenFeature } = require('@openfeature/server-sdk');
const { OFREPProvider } = require('@openfeature/ofrep-provider');
const { OFREPApi } = require('@openfeature/ofrep-core');

async function bulkPoll(baseUrl) {
  const api = new OFREPApi(baseUrl);
  const first = await api.postBulkEvaluateFlags({ context: {} });
  const etag = first.httpResponse.headers.get('ETag');
  const second = await api.postBulkEvaluateFlags({ context: {} }, { headers: [['If-None-Match', etag]] });
  return { first: first.httpStatus, etag, flags: first.value, second: second.httpStatus };
}

async function main() {
  const [baseUrl, ...keys] = process.argv.slice(2);
  await OpenFeature.setProviderAndWait(new OFREPProvider({ baseUrl }));
  const client = OpenFeature.getClient();
  const flags = {};
  for (const key of keys) {
    flags[key] = {
      boolean: await client.getBooleanDetails(key, false, { targetingKey: 'pipeline-1' }),
      string: await client.getStringDetails(key, 'none'),
    };
  }
  let bulk;
  try {
    bulk = await bulkPoll(baseUrl);
  } catch (e) {
    bulk = { error: String(e) };
  }
  await OpenFeature.close();
  process.stdout.write(JSON.stringify({ flags, bulk }) + '\n');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
