"""A real S3-compatible server on loopback (moto's threaded server) for tests and benchmarks."""
import uuid


class LocalS3:
    """A real S3-compatible server on loopback for tests and this benchmark: moto's threaded
    server, with one bucket and an IAM user whose key is checked on every request (a wrong
    secret gets 403 SignatureDoesNotMatch, as from S3). `env` holds the AWS_* variables that
    reach it. moto keeps objects in this process's memory: a stand-in, not a speed reference."""

    def __init__(self, bucket: str = "kdn-origin", region: str = "us-east-1"):
        import json
        import logging
        import urllib.request

        import boto3
        from moto.server import ThreadedMotoServer
        self.bucket = bucket
        logging.getLogger("werkzeug").setLevel(logging.ERROR)      # not a line per request
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        setup = dict(endpoint_url=self.endpoint, region_name=region, aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        iam = boto3.client("iam", **setup)
        user = f"kdn-{uuid.uuid4().hex[:8]}"    # moto keeps one state per process: a user per server
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        s3 = boto3.client("s3", **setup)
        if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
            s3.create_bucket(Bucket=bucket)
        # From here on every request must be signed with the user's key.
        urllib.request.urlopen(urllib.request.Request(
            self.endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
            headers={"Content-Type": "text/plain"}), timeout=10).read()
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                    "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_REGION": region}

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def stop(self) -> None:
        import urllib.request
        urllib.request.urlopen(urllib.request.Request(     # auth off again for the next server
            self.endpoint + "/moto-api/reset-auth", data=b"inf", method="POST",
            headers={"Content-Type": "text/plain"}), timeout=10).read()
        self.server.stop()
