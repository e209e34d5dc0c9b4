# /etc/profile.d/ddpack.sh: pyxis/enroot start tasks in a login shell, which resets PATH from
# /etc/profile and drops the image's ENV PATH; put the bundle's venv first again.
case ":$PATH:" in
  *:/opt/ddpack/venv/bin:*) ;;
  *) PATH="/opt/ddpack/venv/bin:$PATH"; export PATH ;;
esac
